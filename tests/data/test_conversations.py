"""Normalising records: roles, empties, one-sided conversations, malformed records by reason, dedup, splits."""

from __future__ import annotations

import copy
import hashlib
from collections import Counter

import pytest
from data_helpers import qwen3_tokenizer, qwen3_tokenizer_dir, sample_records  # noqa: F401

from dominospec.data.conversations import (
    ROLES, Skip, assign_split, first_prompt, held_out, normalize_record, normalize_records,
)


def _by_id(conversations):
    return {c["id"]: c for c in conversations}


def test_real_sample_keeps_two_sided_conversations_and_names_every_drop():
    conversations, skipped, dropped = normalize_records(sample_records())
    assert [c["id"] for c in conversations] == [
        "i6IyJda_0",
        "J410gdS_0",
        "WJidmXp_0",
        "X1NXUxZ_0",
        "lheleG7_0",
        "95NWF4s_0",
        "52n0vlZ_0",
        "8fC32jy_43",
        "yV4WPEy_0",
        "JPSehOX_0",
        "RnwpeOH_0",
    ]
    # QOL3GJy_0: system only; AJqZA01_1: a lone gpt turn; iondy9s_0: empty human + gpt.
    # RnwpeOH_0 appears twice: first with no messages, then complete (which is kept).
    assert skipped == Counter({"one_sided": 3, "empty_conversation": 1})
    assert dropped == Counter({"leading_assistant": 1})  # 8fC32jy_43 opens with a gpt turn

    by_id = _by_id(conversations)
    assert [m["role"] for m in by_id["95NWF4s_0"]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in by_id["yV4WPEy_0"]["messages"]] == ["system", "user", "assistant"]  # chatgpt
    assert [m["role"] for m in by_id["52n0vlZ_0"]["messages"]] == ["system", "user", "assistant"]  # bing
    assert [m["role"] for m in by_id["JPSehOX_0"]["messages"]] == ["user", "assistant"]  # user + gpt
    assert by_id["8fC32jy_43"]["messages"][0]["role"] == "user"
    for c in conversations:
        assert c["messages"][-1]["role"] == "assistant"
        assert all(m["content"] == m["content"].strip() and m["content"] for m in c["messages"])


VALID = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]


@pytest.mark.parametrize(
    "record, reason",
    [
        ("a string", "not_an_object"),
        (["a", "list"], "not_an_object"),
        ({"id": "x"}, "missing_messages"),
        ({"conversations": "hi"}, "wrong_type"),
        ({"conversations": ["hi", "there"]}, "wrong_type"),
        ({"conversations": [{"from": "human"}, VALID[1]]}, "missing_fields"),
        ({"conversations": [{"speaker": "human", "text": "hi"}, VALID[1]]}, "missing_fields"),
        ({"conversations": [{"from": "human", "value": 3}, VALID[1]]}, "wrong_type"),
        ({"conversations": [{"from": None, "value": "hi"}, VALID[1]]}, "wrong_type"),
        ({"conversations": [{"from": "narrator", "value": "hi"}, VALID[1]]}, "unknown_role"),
        ({"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "wrong_type"),
        ({"id": ["x"], "conversations": VALID}, "wrong_type"),
        ({"conversations": []}, "empty_conversation"),
        ({"conversations": [{"from": "human", "value": "  \n"}]}, "empty_conversation"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "one_sided"),
        ({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "?"}]}, "one_sided"),
    ],
)
def test_malformed_record_is_skipped_under_its_reason(record, reason):
    conversations, skipped, _ = normalize_records([record, {"id": "good", "conversations": VALID}])
    assert [c["id"] for c in conversations] == ["good"]
    assert skipped == Counter({reason: 1})


def test_roles_map_onto_system_user_assistant():
    assert len(ROLES) == 9
    for raw_role, role in ROLES.items():
        messages = [{"role": "user", "content": "q"}, {"from": raw_role.upper(), "value": "x"},
                    {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a"}]
        conversation, _ = normalize_record({"conversations": messages})
        assert [m["role"] for m in conversation["messages"]] == ["user", role, "user", "assistant"], raw_role


def test_openai_text_parts_are_joined_and_whitespace_stripped():
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": " a"}, {"type": "text", "text": "b "}]},
                           {"role": "assistant", "content": "\n c \n"}]}  # fmt: skip
    conversation, _ = normalize_record(record)
    assert [m["content"] for m in conversation["messages"]] == ["ab", "c"]


def test_duplicates_by_id_keep_the_first_and_are_counted():
    first, second = sample_records()[0], copy.deepcopy(sample_records()[0])
    second["conversations"][1]["value"] = "another answer"
    conversations, skipped, _ = normalize_records([first, second, sample_records()[1]])
    assert [c["id"] for c in conversations] == ["i6IyJda_0", "J410gdS_0"]
    assert conversations[0]["messages"][1]["content"] == first["conversations"][1]["value"].strip()
    assert skipped == Counter({"duplicate_id": 1})


def test_records_without_id_get_a_content_hash_so_exact_copies_dedup():
    a = {"conversations": sample_records()[0]["conversations"]}
    b = {"conversations": sample_records()[1]["conversations"]}
    conversations, skipped, _ = normalize_records([a, b, copy.deepcopy(a), {"id": "", **b}])
    assert len(conversations) == 2
    assert all(c["id"].startswith("sha256-") and len(c["id"]) == len("sha256-") + 16 for c in conversations)
    assert conversations[0]["id"] != conversations[1]["id"]
    assert skipped == Counter({"duplicate_id": 2})


def test_integer_ids_are_kept_as_strings():
    conversation, _ = normalize_record({"id": 7, "conversations": VALID})
    assert conversation["id"] == "7"


def test_split_is_the_documented_hash_and_deterministic():
    ids = [f"conv-{i}" for i in range(20000)]
    splits = [assign_split(i, 3, 0.1, 0.2) for i in ids]
    assert splits == [assign_split(i, 3, 0.1, 0.2) for i in ids]
    for conversation_id, split in zip(ids[:200], splits):
        u = int(hashlib.sha256(f"3:{conversation_id}".encode()).hexdigest()[:16], 16) / 2**64
        assert split == ("test" if u < 0.2 else "val" if u < 0.3 else "train")
    counts = Counter(splits)
    # binomial standard deviations: val sqrt(20000*.1*.9) = 42, test sqrt(20000*.2*.8) = 57
    assert abs(counts["val"] - 2000) < 4 * 42 and abs(counts["test"] - 4000) < 4 * 57
    other_seed = [assign_split(i, 4, 0.1, 0.2) for i in ids]
    assert sum(a != b for a, b in zip(splits, other_seed)) > 5000  # the seed reshuffles


def test_zero_fractions_put_everything_in_train():
    assert {assign_split(f"c{i}", 0, 0.0, 0.0) for i in range(1000)} == {"train"}


def test_parts_of_one_conversation_share_a_split():
    for base in (f"conv{i}" for i in range(200)):
        splits = {assign_split(f"{base}_{part}", 0, 0.3, 0.3) for part in range(4)}
        assert splits == {assign_split(base, 0, 0.3, 0.3)}
    # distinct conversations still spread over the splits
    assert {assign_split(f"conv{i}_0", 0, 0.3, 0.3) for i in range(200)} == {"train", "val", "test"}


def _conversation(cid, split, *messages):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return {"id": cid, "split": split, "messages": [{"role": roles[m[0]], "content": m[2:]} for m in messages]}


def test_first_prompt_is_everything_up_to_the_first_user_turn():
    c = _conversation("x", "train", "s:be brief", "u:hi", "a:hello", "u:more")
    assert first_prompt(c["messages"]) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert first_prompt([{"role": "assistant", "content": "alone"}]) == []


def test_train_conversations_opening_with_a_scored_prompt_are_dropped():
    conversations = [
        _conversation("t1", "train", "u:hi", "a:one"),                  # opens with test's prompt: dropped
        _conversation("t2", "train", "u:hi", "a:two", "u:hi", "a:x"),   # likewise, whatever follows
        _conversation("t3", "train", "s:be brief", "u:hi", "a:three"),  # another prompt (a system turn): kept
        _conversation("t4", "train", "u:Hi", "a:four"),                 # another text: kept
        _conversation("t5", "train", "u:later", "a:five", "u:hi", "a:y"),  # hi later on: kept
        _conversation("t6", "train", "u:bye", "a:six"),                 # opens with val's prompt: dropped
        _conversation("x1", "test", "u:hi", "a:test"),
        _conversation("x2", "test", "u:hi", "a:test again"),            # repeats within test are kept
        _conversation("v1", "val", "u:bye", "a:val"),
    ]
    kept, dropped = held_out(conversations)
    assert [c["id"] for c in kept] == ["t3", "t4", "t5", "x1", "x2", "v1"] and dropped == 3
    assert held_out([c for c in conversations if c["split"] == "train"]) == (
        [c for c in conversations if c["split"] == "train"], 0)  # nothing held out: nothing dropped


def test_a_reply_after_a_reply_is_joined_to_it_and_counted():
    record = {"id": "r", "conversations": [
        {"from": "human", "value": "u1"}, {"from": "gpt", "value": "a1"}, {"from": "gpt", "value": "a2"},
        {"from": "human", "value": "u2"}, {"from": "human", "value": "u3"}, {"from": "gpt", "value": "a3"},
        {"from": "human", "value": "  "}, {"from": "gpt", "value": "a4"}, {"from": "gpt", "value": "a5"},
    ]}  # fmt: skip
    conversation, dropped = normalize_record(record)
    assert conversation["messages"] == [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1\n\na2"},
        {"role": "user", "content": "u2"}, {"role": "user", "content": "u3"},  # users in a row stay apart
        {"role": "assistant", "content": "a3\n\na4\n\na5"},  # the empty user message between them is dropped first
    ]  # fmt: skip
    assert dropped == Counter({"joined_to_previous_reply": 3, "empty_message": 1})


def test_sharegpts_replies_after_replies_are_joined_whole_and_render_under_qwen3(qwen3_tokenizer):
    """The packaged ShareGPT: 19 conversations hold 24 replies that follow a reply; joined, each conversation
    keeps every reply's text in order, and Qwen3's template (thinking off) renders all of them."""
    from data_helpers import supervised_runs

    from dominospec.data.chat import render_batch, special_token_ids
    from dominospec.data.sources import read_source

    records = read_source("sharegpt", hub_split="train").records
    conversations, _, dropped = normalize_records(records)
    assert dropped["joined_to_previous_reply"] == 24
    joined, seen = [], set()
    for record in records:  # as normalize_records: the first usable record of an id is kept
        try:
            c, _ = normalize_record(record)
        except Skip:
            continue
        if c["id"] in seen:
            continue
        seen.add(c["id"])
        said = [(ROLES[m["from"].lower()], m["value"].strip()) for m in record["conversations"] if m["value"].strip()]
        first_user = next(i for i, (role, _) in enumerate(said) if role == "user")  # replies before it are dropped
        originals = [text for role, text in said[first_user:] if role == "assistant"]
        replies = [m["content"] for m in c["messages"] if m["role"] == "assistant"]
        assert "\n\n".join(replies) == "\n\n".join(originals)  # every reply's text, in order
        if len(replies) < len(originals):
            joined.append(c)
        roles = [m["role"] for m in c["messages"]]
        assert ("assistant", "assistant") not in zip(roles, roles[1:])
    assert len(joined) == 19
    messages = [c["messages"] for c in joined]
    rendered = render_batch(qwen3_tokenizer, messages, 100_000, special_token_ids(qwen3_tokenizer),
                            {"enable_thinking": False})
    for m, r in zip(messages, rendered):
        replies = [x["content"] + "<|im_end|>" for x in m if x["role"] == "assistant"]
        assert [qwen3_tokenizer.decode(run) for run in supervised_runs(r.input_ids, r.loss_mask)] == replies
