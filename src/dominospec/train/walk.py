"""Validation τ the way the engine experiences it: walk each reply anchor by anchor.

Teacher-forced acceptance at *uniform random* anchors over-weights easy stretches (a loop offers
many anchors that all accept a lot) and so overstates τ. The engine instead starts a round at the
first reply token, accepts n drafts, emits n + 1 tokens and starts the next round there. For greedy
drafting the teacher-forced chain equals the drafted one as long as it is right, so walking the
same way over a reply the target itself wrote gives the engine's τ, up to feature numerics.

For one reply occupying positions s..e-1 of a sequence (loss_mask True there):

    a = s                                   # x_start: the reply's first token (from the prefill)
    while a < e - 1:                        # positions a+1 .. e-1 remain to be emitted
        room = e - 1 - a
        k = min(K, room - 1)                # as the engine: the bonus fills the last slot
        n = leading correct drafts at anchor a, at most k
        emitted += n + 1; rounds += 1; a += n + 1

τ = Σ emitted ÷ Σ rounds over all replies (pooled, docs/design.md §6).

Sampled (`walk_sequence(..., temperature=T)`): a round at anchor a drafts d_i ~ q_i and the
target accepts it with probability min(1, p_i(d_i) / q_i(d_i)) (engine.accept), so draft i is
accepted, given drafts < i were, with probability a_i = Σ_v min(p_i, q_i) (p_i: the target's warped
distribution after x[..a+i-1], q_i: the draft's, slot i - 1 of the block). Read along the reply (the
target's features and the head's teacher-forced GRU see the reply's own tokens, as the greedy walk
does) a round accepts n drafts with probability S_n - S_(n+1), S_n = Π_(i<=n) a_i, S_0 = 1, and
moves to a + n + 1. The walk then carries the expected number of rounds that start at each anchor
(V(s) = 1, V(a + n + 1) += V(a) P_a(n)); τ = emitted ÷ Σ_a V(a), the emitted tokens being the
reply's e - 1 - s as in the greedy walk. Where p_(i) depends on which token was accepted before it
the product is an estimate along the reply; where it does not it is the engine's τ exactly
(tests/train/test_walk_sampled.py runs the engine sampled against it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from dominospec.train.distill import acceptance_probability
from dominospec.train.objective import draft_block_logits, make_blocks


def reply_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """loss_mask [T] bool -> [(s, e)], the maximal runs of supervised positions s..e-1."""
    mask = loss_mask.bool().cpu().tolist()
    spans, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def leading_accepted(correct: torch.Tensor, num_draft: int) -> torch.Tensor:
    """correct [A, Bk] bool (slot j right at anchor a) -> accepted drafts [A], the number of
    leading right slots among the first `num_draft`."""
    return correct[:, :num_draft].long().cumprod(dim=1).sum(dim=1)


@dataclass
class WalkStats:
    """Pooled engine-walk counts; `acceptance_length` is τ, bonus included."""

    emitted: int = 0
    rounds: float = 0  # expected rounds in the sampled walk
    per_reply: list[float] = field(default_factory=list)  # τ of each reply (for a standard error)
    position_accepted: list[float] = field(default_factory=list)  # [K] rounds whose draft k+1 was accepted (expected: sampled)
    position_proposed: list[float] = field(default_factory=list)  # [K] rounds that proposed draft k+1

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.rounds if self.rounds else float("nan")

    def standard_error(self) -> float:
        """Standard error of the mean of per-reply τ (nan with fewer than two replies)."""
        n = len(self.per_reply)
        if n < 2:
            return float("nan")
        t = torch.tensor(self.per_reply, dtype=torch.float64)
        return float(t.std(unbiased=True) / n**0.5)

    def merge(self, other: "WalkStats") -> None:
        self.emitted += other.emitted
        self.rounds += other.rounds
        self.per_reply += other.per_reply
        K = max(len(self.position_proposed), len(other.position_proposed))
        pad = lambda xs: xs + [0] * (K - len(xs))  # noqa: E731
        self.position_accepted = [a + b for a, b in zip(pad(self.position_accepted), pad(other.position_accepted))]
        self.position_proposed = [a + b for a, b in zip(pad(self.position_proposed), pad(other.position_proposed))]

    def as_dict(self) -> dict:
        return {
            "acceptance_length": self.acceptance_length,
            "acceptance_length_se": self.standard_error(),
            "rounds": self.rounds,
            "emitted": self.emitted,
            "replies": len(self.per_reply),
            "acceptance_by_position": [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)],
        }


def walk_reply(accepted: dict[int, int], start: int, end: int, num_draft: int) -> WalkStats:
    """accepted {anchor a -> leading right drafts at a} over one reply s..e-1 -> its walk."""
    stats = WalkStats(position_accepted=[0] * num_draft, position_proposed=[0] * num_draft)
    a = start
    while a < end - 1:
        room = end - 1 - a
        k = min(num_draft, room - 1)  # the engine's K near the end: the bonus fills the last slot
        n = min(accepted[a], k)
        step = n + 1
        stats.emitted += step
        stats.rounds += 1
        for j in range(k):
            stats.position_proposed[j] += 1
        for j in range(n):
            stats.position_accepted[j] += 1
        a += step
    if stats.rounds:
        stats.per_reply.append(stats.acceptance_length)
    return stats


def walk_reply_sampled(acceptance: dict[int, torch.Tensor], start: int, end: int, num_draft: int) -> WalkStats:
    """acceptance {anchor a -> a_i [num_draft], draft i's acceptance given drafts < i were} over one
    reply s..e-1 -> its expected walk (module docstring): rounds and counts by position are
    expectations, emitted the reply's e - 1 - s tokens."""
    stats = WalkStats(position_accepted=[0.0] * num_draft, position_proposed=[0.0] * num_draft)
    visits = [0.0] * (end - start)  # V(a): expected rounds starting at anchor a (index a - start)
    visits[0] = 1.0
    for a in range(start, end - 1):
        v = visits[a - start]
        if v == 0.0:
            continue
        k = min(num_draft, end - 2 - a)  # as the greedy walk: the bonus fills the last slot
        survival = [1.0] + torch.cumprod(acceptance[a][:k].double(), 0).tolist()  # S_0 .. S_k
        stats.rounds += v
        for j in range(k):
            stats.position_proposed[j] += v
            stats.position_accepted[j] += v * survival[j + 1]
        for n in range(k + 1):
            p = survival[n] - (survival[n + 1] if n < k else 0.0)
            visits[a + n + 1 - start] += v * p
    stats.emitted = end - 1 - start
    if stats.rounds:
        stats.per_reply.append(stats.acceptance_length)
    return stats


@torch.no_grad()
def acceptance_probabilities(
    draft, embed_tokens, lm_head, input_ids: torch.Tensor, spans: list[tuple[int, int]], target_features: torch.Tensor,
    target_logits: torch.Tensor, num_draft: int, temperature: float, head: bool = True, chunk: int = 64,
) -> dict[int, torch.Tensor]:
    """input_ids [T], reply spans, target_features [T, n*H], target_logits [T, V] (the target's
    next-token logits after each position), temperature T > 0 -> {anchor a -> a_i [num_draft]}:
    a_i = Σ_v min(p_i, q_i), p_i = softmax(target_logits[a + i - 1] / T), q_i = softmax(the draft's
    logits at slot i - 1 / T), i = 1..num_draft (0 past the sequence): the engine's temperature
    warp (engine.sampling.Sampling without top-k / top-p) of both."""
    T = input_ids.shape[0]
    anchors = torch.cat([torch.arange(s, e - 1) for s, e in spans])
    cfg = draft.config
    out: dict[int, torch.Tensor] = {}
    ids, mask = input_ids[None], torch.ones(1, T, dtype=torch.bool, device=input_ids.device)
    for part in anchors.split(chunk):
        blocks = make_blocks(ids, mask, 0, cfg.block_size, cfg.mask_token_id, anchors=[part.to(input_ids.device)])
        base, final = draft_block_logits(draft, embed_tokens, lm_head, target_features[None], blocks)
        logits = (final if (head and final is not None) else base)[0, :, :num_draft]  # [N, K, V]
        positions = blocks.positions[0, :, :num_draft]  # [N, K]: slot j predicts x[a+1+j] from the target's row a + j
        N, K, V = logits.shape
        q = torch.softmax(logits.reshape(N * K, V).float() / temperature, -1)
        p = torch.softmax(target_logits[positions.clamp(max=T - 1).reshape(-1)].float() / temperature, -1)
        a = acceptance_probability(p, q).view(N, K) * (positions < T - 1).float()
        for anchor, row in zip(part.tolist(), a.cpu()):
            out[anchor] = row
    return out


@torch.no_grad()
def accepted_drafts(
    draft, embed_tokens, lm_head, input_ids: torch.Tensor, spans: list[tuple[int, int]], target_features: torch.Tensor,
    num_draft: int, head: bool = True, chunk: int = 64,
) -> dict[int, int]:
    """input_ids [T], reply spans [(s, e)], target_features [T, n*H] -> {anchor a -> leading right
    drafts at a (<= num_draft)} for every anchor a round may start from (s <= a < e - 1), drafting
    with the head (`head`) or from the base logits alone; `chunk` anchors per draft forward."""
    T = input_ids.shape[0]
    anchors = torch.cat([torch.arange(s, e - 1) for s, e in spans])  # every possible x_start
    # A label counts only inside its own reply: mask positions outside the reply spans.
    supervised = torch.zeros(T, dtype=torch.bool)
    for s, e in spans:
        supervised[s:e] = True
    cfg = draft.config
    accepted: dict[int, int] = {}
    ids, mask = input_ids[None], supervised[None].to(input_ids.device)
    feats = target_features[None]
    for part in anchors.split(chunk):
        blocks = make_blocks(ids, mask, 0, cfg.block_size, cfg.mask_token_id, anchors=[part.to(input_ids.device)])
        base, final = draft_block_logits(draft, embed_tokens, lm_head, feats, blocks)
        logits = final if (head and final is not None) else base  # [1, N, Bk, V]
        correct = (logits[0].argmax(-1) == blocks.labels[0]) & blocks.label_mask[0]  # [N, Bk]
        for a, n in zip(part.tolist(), leading_accepted(correct, num_draft).tolist()):
            accepted[a] = n
    return accepted


def walked_spans(loss_mask: torch.Tensor, first_reply_only: bool = True,
                 horizon: Optional[int] = None) -> list[tuple[int, int]]:
    """loss_mask [T] -> the reply spans a walk covers: replies of >= 2 tokens (the first alone when
    `first_reply_only`: the engine is evaluated on first-turn prompts), each cut to its first
    `horizon` tokens when given (the engine's max_new_tokens: it never decodes past them)."""
    spans = [(s, e) for s, e in reply_spans(loss_mask) if e - s >= 2]
    spans = spans[:1] if first_reply_only else spans
    if horizon is not None:
        spans = [(s, min(e, s + horizon)) for s, e in spans]
    return [(s, e) for s, e in spans if e - s >= 2]


def walk_sequence(
    draft, embed_tokens, lm_head, input_ids: torch.Tensor, loss_mask: torch.Tensor, target_features: torch.Tensor,
    num_draft: int, head: bool = True, chunk: int = 64, first_reply_only: bool = True, horizon: Optional[int] = None,
    temperature: Optional[float] = None, target_logits: Optional[torch.Tensor] = None,
) -> WalkStats:
    """One sequence: input_ids / loss_mask [T], target_features [T, n*H] -> the engine walk over
    its replies (`walked_spans`), drafting with the head (`head`) or from the base logits alone.

    Greedy (`temperature` None or 0): the draft is scored at every anchor a reply may start a round
    from (`accepted_drafts`), then each reply is walked over those scores. Sampled (`temperature`
    T > 0, `target_logits` [T, V] given): the expected walk over `acceptance_probabilities`."""
    spans = walked_spans(loss_mask, first_reply_only, horizon)
    total = WalkStats(position_accepted=[0] * num_draft, position_proposed=[0] * num_draft)
    if not spans:
        return total
    if temperature:
        if target_logits is None:
            raise ValueError("a sampled walk needs the target's logits over the sequence")
        acceptance = acceptance_probabilities(draft, embed_tokens, lm_head, input_ids, spans, target_features,
                                              target_logits, num_draft, temperature, head, chunk)
        for s, e in spans:
            total.merge(walk_reply_sampled(acceptance, s, e, num_draft))
        return total
    accepted = accepted_drafts(draft, embed_tokens, lm_head, input_ids, spans, target_features, num_draft, head, chunk)
    for s, e in spans:
        total.merge(walk_reply(accepted, s, e, num_draft))
    return total


__all__ = ["WalkStats", "reply_spans", "leading_accepted", "walk_reply", "walk_reply_sampled", "acceptance_probabilities",
           "accepted_drafts", "walked_spans", "walk_sequence"]
