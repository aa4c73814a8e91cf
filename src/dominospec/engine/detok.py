"""Incremental detokenisation: the text of a growing answer at O(new tokens) per step, not O(answer).

Decoding the whole answer after every round costs O(n) per round and O(n^2) per answer. Instead
(the offsets scheme of TGI / vLLM) only a short window is decoded: the tokens since `prefix_offset`
(the last few tokens already turned into text, which give the decoder its left context: a leading
space, a byte-level merge) both with and without the new tokens; the difference is the new text.
Text is released only when it does not end in U+FFFD (a character whose bytes are not all there
yet); those tokens wait for the next push.

Invariant: `text` == tokenizer.decode(tokens[:read_offset], skip_special_tokens=True) for the
byte-level BPE and SentencePiece tokenizers of the targets here (checked in tests/engine).
"""

from __future__ import annotations

from typing import Any, Sequence


class IncrementalDetokenizer:
    """Token ids pushed in, text deltas out; `text` is everything released so far."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window (tokens already in `text`)
        self.read_offset = 0  # tokens[:read_offset] are in `text`
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        """Newly committed ids -> the text they complete (possibly "", when bytes are still missing)."""
        self.tokens.extend(int(t) for t in ids)
        before = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
