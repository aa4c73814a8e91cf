"""Acceptance (docs/design.md §1.5): which of a verified proposal's rows the target keeps, and its next token.

Row 0 is x_start, row r a proposed token tokens[r] under a parent row parents[r] < r (a chain, a fork's
branches, any tree); row r's logits are the target's next-token distribution after the path to r.
- greedy (`GreedyWalk`): from row 0, descend into the child whose token is the target's argmax (two such:
  the deeper acceptance, the earlier row on a tie); then the argmax after the path: exactly AR's tokens.
- sampled (`accept_sampled`): recursive rejection sampling (SpecInfer). A row's children c_1 .. c_m
  are tried in row order: child i, from q_i, is accepted with probability min(1, p_i(c_i) / q_i(c_i)),
  p_1 = p, p_{i+1} = norm(max(0, p_i - q_i)); all rejected: the next token is drawn from p_{m+1} (at a
  leaf, from p). A point-mass child (a lookup token, a tree node) has q_i = 1 at c_i, so
  p_i(c_i) = p(c_i) / (1 - p(c_1) - ... - p(c_{i-1})); a sampled chain's draw (its parent's only child)
  takes the classic test u < p(c) / q(c), residual max(0, p - q). Every committed token is an exact
  draw from the target's warped distribution (chi-square tests in tests/engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Accepted:
    """rows: the accepted path's verify rows, row 0 first; tokens: their tokens (row 0's left out),
    then the target's next token; walk: the target's greedy choices on every row (None sampled)."""

    rows: list[int]
    tokens: list[int]
    walk: Optional["GreedyWalk"]


def children_of(parents: list[int]) -> list[list[int]]:
    """Parent row per row (row 0's ignored) -> each row's child rows, in row order."""
    kids: list[list[int]] = [[] for _ in parents]
    for row in range(1, len(parents)):
        kids[parents[row]].append(row)
    return kids


class GreedyWalk:
    """The target's greedy choices on a verified tree, read back once: choice [T] (its argmax after
    each row's path), proposed [T] (each row's token; row 0's is x_start), kids (child rows by row)."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor):
        T = logits.shape[0]
        both = torch.cat([logits.argmax(-1), tokens[:T].to(torch.long), parents[:T].to(torch.long)]).tolist()
        self.choice, self.proposed, self.kids = both[:T], both[T:2 * T], children_of(both[2 * T:])

    def path(self, rows: Optional[range] = None) -> list[int]:
        """The longest accepted path from row 0 through `rows` only (all rows: None; row 0 not
        listed; the earlier row on a tie): each row's token is the target's choice after its parent's path."""
        allowed = range(1, len(self.choice)) if rows is None else rows

        def deepest(row: int) -> list[int]:
            best: list[int] = []
            for kid in self.kids[row]:
                if kid in allowed and self.proposed[kid] == self.choice[row]:
                    below = deepest(kid)
                    if len(below) + 1 > len(best):
                        best = [kid] + below
            return best

        return deepest(0)


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> Accepted:
    """Verify ids [T] (row 0 x_start), parent rows [T], logits [T, V] -> the longest accepted path."""
    walk = GreedyWalk(tokens, parents, logits)
    path = walk.path()
    return Accepted([0] + path, [walk.proposed[r] for r in path] + [walk.choice[path[-1] if path else 0]], walk)


def residual(p: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Target distribution [V], tokens of the rejected point-mass children [m] -> p with their mass
    removed, renormalised (max(0, p - q) over the point masses)."""
    out = p.index_fill(0, rejected, 0.0) if rejected.numel() else p
    total = out.sum()
    return out / total if float(total) > 0 else p


def accept_sampled(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, q: Optional[torch.Tensor],
                   generator: Optional[torch.Generator]) -> Accepted:
    """Verify ids [T], parent rows [T], the target's warped probabilities [T, V], and q [T - 1, V] (q[r - 1]:
    the distribution row r's token was drawn from; None: every row a point mass) -> the path,
    by recursive rejection sampling (module docstring). Host reads: one of the tree, one of the draws."""
    T = probs.shape[0]
    rows = torch.arange(1, T, device=probs.device)
    at_parent = probs[parents[1:T].to(torch.long), tokens[1:T].to(torch.long)] if T > 1 else probs.new_zeros(0)
    q_at = (q[rows - 1, tokens[1:T].to(torch.long)].to(probs.dtype) if q is not None and T > 1
            else torch.zeros_like(at_parent))
    host = torch.cat([tokens[:T].to(probs.dtype), parents[:T].to(probs.dtype), probs.new_zeros(1), at_parent,
                      probs.new_zeros(1), q_at]).tolist()
    proposed, kids = [int(t) for t in host[:T]], children_of([int(p) for p in host[T:2 * T]])
    p_at, q_of = host[2 * T:3 * T], host[3 * T:]  # row r: p(tokens[r]) at r's parent; q_r(tokens[r]) (0: a point mass)
    draws = torch.rand(T, generator=generator, device=probs.device, dtype=torch.float64).tolist()  # one per row
    row, path = 0, [0]
    while True:
        removed, taken, seen, drawn = 0.0, None, set(), None
        for kid in kids[row]:
            if q_of[kid] > 0:  # a draw from q: its parent's only child
                if draws[kid] < p_at[kid] / q_of[kid]:
                    taken = kid
                drawn = kid
                break
            if proposed[kid] in seen:  # a repeated token: its mass is gone from the residual already
                continue
            accept = p_at[kid] / (1.0 - removed) if removed < 1.0 else 0.0
            if draws[kid] < accept:
                taken = kid
                break
            removed += p_at[kid]
            seen.add(proposed[kid])
        if taken is None:
            break
        row = taken
        path.append(row)
    if drawn is not None:  # the sampled child was rejected: the residual max(0, p - q)
        dist = (probs[row] - q[drawn - 1].to(probs.dtype)).clamp_min(0.0)
        dist = dist if float(dist.sum()) > 0.0 else probs[row]  # p == q up to rounding: nothing left
    else:
        dist = residual(probs[row], torch.tensor([proposed[k] for k in kids[row]], dtype=torch.long,
                                                 device=probs.device))
    nxt = int(torch.multinomial(dist[None], 1, generator=generator)[0, 0])
    return Accepted(path, [proposed[r] for r in path[1:]] + [nxt], None)


def accept(ids: torch.Tensor, parents: torch.Tensor, q: Optional[torch.Tensor], logits: torch.Tensor,
           sampling, generator: Optional[torch.Generator]) -> Accepted:
    """Verify ids [T] (row 0 x_start), parent rows [T], the draws' q [T - 1, V] or None, the verify's
    logits [T, V] -> what the target accepts: greedy, its longest path; sampled, recursive rejection."""
    if sampling.greedy:
        return accept_greedy(ids, parents, logits)
    return accept_sampled(ids, parents, sampling.probs(logits), q, generator)
