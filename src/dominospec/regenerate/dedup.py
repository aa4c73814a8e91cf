"""Exact deduplication of regenerated sequences, counted per source.

    seen = Dedup("tokens")             # none | tokens | text
    seen.first(source, input_ids, messages) -> True for the first sequence with its key, else False

`tokens`: the key is the sequence's token ids (prompt and reply). `text`: the messages' roles and
contents, lowercased with every run of whitespace made one space (a sampled reply that differs
from the greedy one in spacing or case only is a repeat). The first sequence with a key is kept,
so the order sequences come in decides which source keeps a shared one (the stage's order:
conversations, code, self-written prompts; the main reply before the samples).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Sequence

_SPACE = re.compile(r"\s+")


def normalised_text(messages: Sequence[dict[str, str]]) -> str:
    """Messages -> `role: content` lines, lowercased, whitespace runs as one space."""
    return "\n".join(f"{m['role']}: {_SPACE.sub(' ', m['content']).strip().lower()}" for m in messages)


class Dedup:
    """Keys seen so far, and per source how many sequences were repeats (`duplicates`)."""

    def __init__(self, mode: str):
        if mode not in ("none", "tokens", "text"):
            raise ValueError(f"dedup mode must be none, tokens or text, got {mode!r}")
        self.mode, self.seen, self.duplicates = mode, set(), Counter()

    def first(self, source: str, input_ids: Sequence[int], messages: Sequence[dict[str, str]]) -> bool:
        """Whether this sequence is the first with its key (always, with mode none); counts a repeat."""
        if self.mode == "none":
            return True
        if self.mode == "tokens":
            raw = b",".join(str(int(t)).encode() for t in input_ids)
        else:
            raw = normalised_text(messages).encode()
        key = hashlib.blake2b(raw, digest_size=16).digest()
        if key in self.seen:
            self.duplicates[source] += 1
            return False
        self.seen.add(key)
        return True
