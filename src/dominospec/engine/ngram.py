"""Prompt-lookup drafting (the `ngram` mode): what followed the last n-gram the last time it occurred.

No forward pass (Saxena's prompt-lookup decoding, SGLang's NGRAM). For n = max_ngram down to min_ngram
the context's last n tokens are looked up among their earlier occurrences; the most recent wins, and
the up to K tokens after it are the draft (none: a plain step). `NgramIndex` keeps, for every n, a dict
n-gram -> end position, updated as tokens are appended: a lookup is O(max_ngram) dict probes.
"""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """Index of the n-grams (min_ngram <= n <= max_ngram) of a growing token sequence."""

    def __init__(self, min_ngram: int, max_ngram: int):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # last[n][gram] = end index (exclusive) of the most recent occurrence seen so far
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.previous: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram ending at a new position is indexed."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                gram = tuple(self.tokens[end - n : end])
                table = self.last[n]
                if gram in table:
                    self.previous[n][gram] = table[gram]  # the occurrence before the newest one
                table[gram] = end

    def propose(self, k: int) -> list[int]:
        """-> up to k tokens that followed the most recent earlier occurrence of the longest
        matching suffix n-gram (empty when the suffix never occurred before, or k == 0)."""
        end = len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            gram = tuple(self.tokens[end - n :])
            at = self.previous[n].get(gram)  # the suffix itself is the newest occurrence
            if at is not None and at < end:
                return self.tokens[at : at + k]
        return []
