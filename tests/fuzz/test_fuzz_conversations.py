"""Fuzzed raw records -> conversations: every record is kept or skipped under a named reason, every
message of a kept record is kept or counted as dropped, and what is kept obeys the conversation
invariants (roles, stripped non-empty UTF-8 text, user first, assistant last).
Run: python -m pytest tests/fuzz/test_fuzz_conversations.py -q
"""

from __future__ import annotations

from fuzz_helpers import JSON, TEXT, fuzz
from hypothesis import given
from hypothesis import strategies as st

from dominospec.data.conversations import ASSISTANT, SYSTEM, USER, Skip, normalize_record, normalize_records

ROLE = st.sampled_from(["human", "gpt", "chatgpt", "bard", "bing", "user", "assistant", "model", "system", "SYSTEM",
                        "Human", "tool", "narrator", ""]) | TEXT | JSON
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}),
                          max_size=3) | JSON
SHAREGPT = st.fixed_dictionaries({"from": ROLE, "value": CONTENT})
OPENAI = st.fixed_dictionaries({"role": ROLE, "content": CONTENT})
MESSAGE = st.one_of(SHAREGPT, OPENAI, JSON)
PLAUSIBLE = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system"]), "value": TEXT})  # mostly kept
RECORD = st.one_of(
    st.fixed_dictionaries({"conversations": st.lists(PLAUSIBLE, min_size=2, max_size=6)}, optional={"id": TEXT}),
    st.fixed_dictionaries({"conversations": st.lists(MESSAGE, max_size=6)}, optional={"id": TEXT | JSON}),
    st.fixed_dictionaries({"messages": st.lists(SHAREGPT | OPENAI, max_size=6)}, optional={"id": TEXT | st.integers()}),
    JSON,
)
REASONS = {"not_an_object", "missing_messages", "wrong_type", "missing_fields", "unknown_role", "invalid_text",
           "empty_conversation", "one_sided", "duplicate_id"}
DROPS = {"empty_message", "leading_assistant", "trailing_unanswered"}


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@given(records=st.lists(RECORD, max_size=8))
@fuzz(400)
def test_every_record_is_kept_or_counted(records):
    conversations, skipped, dropped = normalize_records(records)
    assert len(conversations) + sum(skipped.values()) == len(records)
    assert set(skipped) <= REASONS and set(dropped) <= DROPS
    assert len({c["id"] for c in conversations}) == len(conversations)
    for c in conversations:
        roles = [m["role"] for m in c["messages"]]
        assert set(roles) <= {USER, ASSISTANT, SYSTEM} and USER in roles and roles[-1] == ASSISTANT
        assert next(r for r in roles if r != SYSTEM) == USER
        assert isinstance(c["id"], str) and utf8(c["id"])
        assert all(m["content"] and m["content"] == m["content"].strip() and utf8(m["content"]) for m in c["messages"])


@given(record=RECORD)
@fuzz(400)
def test_every_message_of_a_kept_record_is_kept_or_counted(record):
    try:
        conversation, dropped = normalize_record(record)
    except Skip as skip:
        assert skip.reason in REASONS
        return
    raw = record.get("conversations", record.get("messages"))
    assert len(conversation["messages"]) + sum(dropped.values()) == len(raw)
