"""Raw records -> normalised conversations, deduplicated, each with its split.

A normalised conversation is `{"id": str, "messages": [{"role", "content"}, ...]}` with
  - roles in {system, user, assistant} (ShareGPT's human/gpt/chatgpt/bard/bing and OpenAI's
    user/assistant/model mapped onto them);
  - contents stripped of surrounding whitespace, none empty;
  - at least one user and one assistant message, the first non-system message a user one, and
    the last message an assistant one (nothing unsupervised is left dangling at the end);
  - no two assistant messages in a row: a reply that follows a reply is joined to it, after a blank
    line (`REPLY_JOIN`), into one assistant message (counted in `dropped_messages` as
    `joined_to_previous_reply`). ShareGPT holds 19 such pairs in 17,390 conversations: a reply
    continued mid-sentence, or a reply to a user message that was empty and dropped. A chat model
    answers one user turn with one reply, and Qwen3's template cannot render the second one's
    prompt as the conversation shows it. User messages in a row stay as they are.

Both record forms are accepted, told apart per message: ShareGPT `{"from", "value"}` and OpenAI
`{"role", "content"}`, under a `conversations` or a `messages` list. A record that cannot be
used is skipped under a named reason (text holding lone surrogates, which UTF-8 cannot encode, is
`invalid_text`); a message that is dropped from a kept conversation is counted separately
(`dropped_messages`).
"""

from __future__ import annotations

import hashlib
import re
import json
from collections import Counter
from typing import Any, Iterable

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLES = {
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bard": ASSISTANT,
    "bing": ASSISTANT,
    "assistant": ASSISTANT,
    "model": ASSISTANT,
    "system": SYSTEM,
}
SPLITS = ("train", "val", "test")
REPLY_JOIN = "\n\n"  # between two assistant messages in a row, joined into one


class Skip(Exception):
    """A record that cannot become a conversation; `reason` names why (a key of `skipped`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def normalize_record(record: Any) -> tuple[dict[str, Any], Counter]:
    """One raw record -> ({"id", "messages"}, dropped-message counts); raises Skip(reason)."""
    if not isinstance(record, dict):
        raise Skip("not_an_object")
    raw_messages = record.get("conversations", record.get("messages"))
    if raw_messages is None:
        raise Skip("missing_messages")
    if not isinstance(raw_messages, list):
        raise Skip("wrong_type")

    dropped: Counter = Counter()
    messages = []
    for raw in raw_messages:
        role, content = _read_message(raw)
        content = content.strip()
        if content:
            messages.append({"role": role, "content": content})
        else:
            dropped["empty_message"] += 1
    if not messages:
        raise Skip("empty_conversation")
    messages = _join_replies(_trim(messages, dropped), dropped)
    if not any(m["role"] == ASSISTANT for m in messages):  # no user turn ever answered
        raise Skip("one_sided")
    return {"id": _record_id(record, messages), "messages": messages}, dropped


def normalize_records(records: Iterable[Any]) -> tuple[list[dict[str, Any]], Counter, Counter]:
    """Raw records -> (conversations in input order, skipped reason -> count, dropped messages).

    Deduplicates by id: the first usable record with an id wins, later ones count as `duplicate_id`.
    """
    conversations, seen = [], set()
    skipped: Counter = Counter()
    dropped: Counter = Counter()
    for record in records:
        try:
            conversation, record_dropped = normalize_record(record)
        except Skip as skip:
            skipped[skip.reason] += 1
            continue
        if conversation["id"] in seen:
            skipped["duplicate_id"] += 1
            continue
        seen.add(conversation["id"])
        dropped.update(record_dropped)
        conversations.append(conversation)
    return conversations, skipped, dropped


# ShareGPT splits one long conversation into records "<id>_0", "<id>_1", ...: they share a split.
_PART_SUFFIX = re.compile(r"_\d+$")


def assign_split(conversation_id: str, split_seed: int, val_fraction: float, test_fraction: float) -> str:
    """id -> "train" | "val" | "test", from sha256(f"{split_seed}:{base id}") alone (stable across
    runs and sources). The base id drops a trailing "_<n>" part number, so the parts of one
    conversation never straddle train and test."""
    base = _PART_SUFFIX.sub("", conversation_id)
    digest = hashlib.sha256(f"{split_seed}:{base}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def first_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Normalised messages -> the prompt a first turn answers: every message up to and including the
    first user one (what evaluate's `sharegpt` suite sends); [] when there is no user message."""
    end = next((i for i, m in enumerate(messages) if m["role"] == USER), None)
    return [] if end is None else [{"role": m["role"], "content": m["content"]} for m in messages[: end + 1]]


def _prompt_key(messages: list[dict[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((m["role"], m["content"]) for m in first_prompt(messages))


def held_out(conversations: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Conversations with their "split" -> (those kept, train conversations dropped).

    A train conversation is dropped when its first prompt is also the first prompt of a val or test
    conversation: the draft must not learn the target's answer to a prompt it is then scored on.
    ShareGPT repeats prompts under different ids: split by id alone, 23 of the 170 test prompts and
    14 of the 173 val prompts also opened train conversations (178 of them; "hi" 48, "Continue
    writing please" 28), and a draft that learnt the target's answer to one reads a τ there that
    no new prompt gets. Val and test are left whole: the suites stay the same prompts."""
    scored = {_prompt_key(c["messages"]) for c in conversations if c["split"] != "train"}
    kept = [c for c in conversations if c["split"] != "train" or _prompt_key(c["messages"]) not in scored]
    return kept, len(conversations) - len(kept)


def _read_message(raw: Any) -> tuple[str, str]:
    """One message in either form -> (normalised role, content); raises Skip."""
    if not isinstance(raw, dict):
        raise Skip("wrong_type")
    if "from" in raw or "value" in raw:
        keys = ("from", "value")
    elif "role" in raw or "content" in raw:
        keys = ("role", "content")
    else:
        raise Skip("missing_fields")
    if any(k not in raw for k in keys):
        raise Skip("missing_fields")
    role, content = raw[keys[0]], raw[keys[1]]
    if isinstance(content, list):  # OpenAI content parts: only text parts are usable
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise Skip("wrong_type")
        content = "".join(p["text"] for p in content)
    if not isinstance(role, str) or not isinstance(content, str):
        raise Skip("wrong_type")
    if role.lower() not in ROLES:
        raise Skip("unknown_role")
    if not _is_utf8(content):
        raise Skip("invalid_text")
    return ROLES[role.lower()], content


def _trim(messages: list[dict[str, str]], dropped: Counter) -> list[dict[str, str]]:
    """Drop assistant messages before the first user one, and unanswered messages after the last assistant one."""
    kept, seen_user = [], False
    for m in messages:
        if m["role"] == ASSISTANT and not seen_user:
            dropped["leading_assistant"] += 1
            continue
        seen_user = seen_user or m["role"] == USER
        kept.append(m)
    while kept and kept[-1]["role"] != ASSISTANT:
        kept.pop()
        dropped["trailing_unanswered"] += 1
    return kept


def _join_replies(messages: list[dict[str, str]], dropped: Counter) -> list[dict[str, str]]:
    """Join each assistant message that follows an assistant message to it, after REPLY_JOIN."""
    joined: list[dict[str, str]] = []
    for m in messages:
        if joined and m["role"] == joined[-1]["role"] == ASSISTANT:
            joined[-1] = {"role": ASSISTANT, "content": joined[-1]["content"] + REPLY_JOIN + m["content"]}
            dropped["joined_to_previous_reply"] += 1
        else:
            joined.append(m)
    return joined


def _record_id(record: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """The record's own id, or a hash of its normalised content when it has none."""
    rid = record.get("id")
    if rid is None or (isinstance(rid, str) and not rid.strip()):
        text = json.dumps(messages, ensure_ascii=False, sort_keys=True)
        return "sha256-" + hashlib.sha256(text.encode()).hexdigest()[:16]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise Skip("wrong_type")
    if isinstance(rid, str) and not _is_utf8(rid):
        raise Skip("invalid_text")
    return str(rid).strip()


def _is_utf8(text: str) -> bool:
    """False for text holding lone surrogates: JSON's "\\ud800" escape decodes to one, but neither UTF-8,
    Arrow nor a tokenizer can hold it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
