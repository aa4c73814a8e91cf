"""Sampling and the two lossless acceptance rules.

`Sampling` turns logits into the distribution tokens are drawn from: temperature, then top-k,
then top-p, applied identically to the target's p and the draft's q. Temperature 0 is greedy.

Acceptance of the draft tokens d_1..d_K against the verify logits (row i = the target's
next-token logits after verify_ids[i], verify_ids = [x_start, d_1..d_K]):

- greedy: d_k is accepted while it equals the target's argmax; the next token is the target's
  argmax after the accepted prefix (correction, or bonus when all K are accepted).
- sampled (lossless speculative sampling): d_k is accepted with probability min(1, p_k(d_k) /
  q_k(d_k)); at the first rejection the next token is drawn from normalise(max(0, p_k - q_k));
  when all are accepted the bonus is drawn from p_{K+1}. Every emitted token is then an exact
  sample of the target's (warped) distribution, whatever q is, provided d_k was drawn from q_k.
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


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Drafts [K], verify logits [K+1, V] -> (accepted count n in 0..K, next token id)."""
    K = draft_tokens.shape[0]
    both = torch.cat([draft_tokens.to(torch.long), target_logits.argmax(-1)]).tolist()  # one device -> host copy
    return first_mismatch(both[:K], both[K:])


def first_mismatch(drafts: list[int], choice: list[int]) -> tuple[int, int]:
    """Drafts [K], the target's greedy tokens [K+1] -> (n: the drafts before the first that differs, choice[n])."""
    n = next((i for i, (d, c) in enumerate(zip(drafts, choice)) if d != c), len(drafts))
    return n, choice[n]


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: Optional[torch.Generator],
) -> tuple[int, int]:
    """Drafts [K] drawn from q [K, V], target p [K+1, V] -> (accepted count n, next token id).

    Lossless speculative sampling (module docstring). p and q must be warped the same way.
    """
    K = draft_tokens.shape[0]
    if K:
        rows = torch.arange(K, device=draft_tokens.device)
        p = target_probs[rows, draft_tokens]  # [K]
        q = draft_probs[rows, draft_tokens]  # [K] > 0: d_k was drawn from q_k
        u = torch.rand(K, generator=generator, device=p.device)
        n = int((u * q < p).long().cumprod(0).sum())  # u < p/q, i.e. accept w.p. min(1, p/q)
    else:
        n = 0
    if n == K:
        dist = target_probs[K]  # bonus
    else:
        dist = (target_probs[n] - draft_probs[n]).clamp_min(0.0)  # residual
        if float(dist.sum()) <= 0.0:  # p == q up to rounding: the residual is empty
            dist = target_probs[n]
    return n, int(torch.multinomial(dist[None], 1, generator=generator)[0, 0])
