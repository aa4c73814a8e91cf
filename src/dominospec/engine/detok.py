"""Incremental detokenisation: the text of a growing answer at O(new tokens) per step, not O(answer).

Decoding the whole answer after every round costs O(n) per round and O(n^2) per answer. Instead
(the offsets scheme of TGI / vLLM) only a short window is decoded: the tokens since `prefix_offset`
(the last few tokens already turned into text, which give the decoder its left context: a leading
space, a byte-level merge) both with and without the new tokens; the difference is the new text.
Text is released only when it does not end in U+FFFD (a character whose bytes are not all there
yet); those tokens wait for the next push.

`preview()` adds the decodable part of the tokens still held back (streaming shows it at once).

Invariant: `text` == decode(tokens[:read_offset]) for the byte-level BPE and SentencePiece
tokenizers of the targets here (checked in tests/engine/test_detok.py). `decode` maps ids to text
(the engine's: `tokenizer.decode(ids, skip_special_tokens=True)`).
"""

from __future__ import annotations

from typing import Callable, Sequence


class IncrementalDetokenizer:
    """Token ids pushed in, text deltas out; `text` is everything released so far."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window (tokens already in `text`)
        self.read_offset = 0  # tokens[:read_offset] are in `text`
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        """Newly committed ids -> the text they complete (possibly "", when bytes are still missing)."""
        self.tokens.extend(int(t) for t in ids)
        before, after = self._window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def preview(self) -> str:
        """`text` plus what the held-back tokens already decode to, without a trailing U+FFFD."""
        if self.read_offset == len(self.tokens):
            return self.text
        before, after = self._window()
        return self.text + after[len(before) :].rstrip("\ufffd")

    def _window(self) -> tuple[str, str]:
        """-> decode(tokens[prefix_offset:read_offset]), decode(tokens[prefix_offset:])."""
        window = self.tokens[self.prefix_offset :]
        done = self.read_offset - self.prefix_offset
        return (self.decode(window[:done]) if done else ""), (self.decode(window) if window else "")
