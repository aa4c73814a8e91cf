"""Token ids in, text deltas out: what a streaming response sends, chunk by chunk.

`TextStreamer.push(ids) -> delta` decodes the committed tokens incrementally (stops: a few
tokens per push, not the whole answer; the same decode as the engine's, special tokens skipped),
searches the new text (plus a stop string's length before it) for stop strings, and returns the
new text, holding back
  - a trailing U+FFFD (a character whose bytes are not all there yet), and
  - a suffix that could be the beginning of a stop string (it may be completed by the next round,
    and no text at or after a stop string may ever be sent).
`finish(final_text) -> delta` returns the rest of the engine's final text, which is authoritative.
Invariant: the deltas concatenate to a prefix of the final text, and with `finish` to all of it.
"""

from __future__ import annotations

from typing import Callable

from dominospec.stops import IncrementalDetokenizer, cut_at_stop_string


def stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class TextStreamer:
    """Incremental text of one generation; see the module docstring."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()):
        self.detok, self.stops = IncrementalDetokenizer(decode), stops
        self.longest = max(map(len, stops), default=0)
        self.searched = 0  # characters of the text already searched for stop strings
        self.cut: int | None = None  # where the first stop string starts, once found
        self.sent = ""  # text already returned: always a prefix of the final text

    def push(self, ids: list[int]) -> str:
        """Newly committed token ids -> the text that may be sent now (possibly "")."""
        self.detok.push(ids)
        text = self.detok.preview()
        if self.cut is None and self.stops:
            self.cut = cut_at_stop_string(text, self.stops, max(0, self.searched - self.longest))
            self.searched = len(self.detok.text)  # the preview's tail may still change: searched again next time
        if self.cut is not None:  # nothing at or after the first stop string is ever sent
            text = text[: self.cut]
        else:
            text = text[: len(text) - stop_prefix_length(text, self.stops)]
        return self._advance(text)

    def finish(self, final_text: str) -> str:
        """The engine's final text -> what is left to send."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new, or a decode that rewrote earlier text: wait for the final text
        delta, self.sent = text[len(self.sent):], text
        return delta
