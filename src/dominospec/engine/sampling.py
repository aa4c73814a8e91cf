"""How tokens are drawn: `Sampling` warps logits (temperature, then top-k, then top-p) alike for the
target's p and the draft's q; temperature 0 is greedy. The lossless acceptance is engine.accept's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] -> warped probabilities [N, V] (float32; rows sum to 1)."""
        scores = logits.float() / self.temperature
        V = scores.shape[-1]
        if 0 < self.top_k < V:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]  # [N, 1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            sorted_probs = sorted_scores.softmax(-1)
            # Drop a token when the mass strictly before it already reaches top_p (the first stays).
            drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            drop_sorted[..., 0] = False  # a top_p below float32's smallest value (1e-300) rounds to 0 and would drop it
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.softmax(-1)

    def sample(self, logits: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        """Logits [N, V] -> tokens [N] (argmax when greedy)."""
        if self.greedy:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits), 1, generator=generator)[:, 0]
