"""Repetition-loop detection for one reply, token by token.

A reply is in a loop when the n-gram ending at its newest token has occurred `repeats` times in
it (overlaps count). The cut keeps one copy of the loop: the reply ends where the n-gram's second
occurrence starts (a loop of period p is cut after its first p tokens). `ngram` None or 0: never.
"""

from __future__ import annotations

from typing import Optional


class LoopDetector:
    """Feed a reply's tokens one at a time; `push` -> None, or the length to cut the reply to."""

    def __init__(self, ngram: Optional[int], repeats: int):
        self.ngram, self.repeats = ngram or 0, repeats
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where it starts in the reply

    def push(self, token: int) -> Optional[int]:
        """One more reply token -> the cut length (tokens to keep) once a loop is found, else None."""
        self.tokens.append(token)
        if not self.ngram or len(self.tokens) < self.ngram:
            return None
        start = len(self.tokens) - self.ngram
        seen = self.starts.setdefault(tuple(self.tokens[start:]), [])
        seen.append(start)
        return seen[1] if len(seen) >= self.repeats else None
