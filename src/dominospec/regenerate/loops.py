"""Repetition-loop detection for one reply, token by token.

A reply is in a loop when the n-gram ending at its newest token has occurred `repeats` times in
it (overlaps count). The cut keeps one copy of the loop: the reply ends where the n-gram's second
occurrence starts (a loop of period p is cut after its first p tokens). `ngram` None or 0: never.

`LoopDetector` follows one reply on the host (today's slot decoder); `loop_cuts` checks a batch of
replies held in a device buffer at once (the static decoder, inside its CUDA graph) and returns
what `LoopDetector.push` would after each reply's newest token.
"""

from __future__ import annotations

from typing import Optional

import torch


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


def loop_cuts(replies: torch.Tensor, counts: torch.Tensor, ngram: int, repeats: int) -> torch.Tensor:
    """replies [B, R] (row b's first counts[b] tokens are its reply), counts [B] -> [B] int64: the cut
    `LoopDetector(ngram, repeats).push` returns after token counts[b] - 1, or -1 (no loop). Tensor ops only."""
    B, R = replies.shape
    if not ngram or R < ngram:
        return torch.full_like(counts, -1)
    last_start = counts - ngram  # [B] where the newest n-gram starts
    span = last_start.clamp(min=0)[:, None] + torch.arange(ngram, device=replies.device)  # [B, n]
    newest = replies.gather(1, span.clamp(max=R - 1))  # [B, n]
    windows = replies.unfold(1, ngram, 1)  # [B, W, n], W = R - n + 1: the n-gram at every start
    starts = torch.arange(windows.shape[1], device=replies.device)
    same = (windows == newest[:, None, :]).all(-1) & (starts[None, :] <= last_start[:, None])  # [B, W]
    seen = same.cumsum(1)  # [B, W] occurrences up to each start
    second = ((seen == 2) & same).float().argmax(1)  # where the second occurrence starts
    return torch.where((seen[:, -1] >= repeats) & (last_start >= 0), second, torch.full_like(counts, -1))
