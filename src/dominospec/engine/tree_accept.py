"""Acceptance on a verified tree of any shape: greedy longest path, and lossless sampling.

The verify rows: row 0 is x_start; every other row r holds a proposed token tokens[r] and a parent
row parents[r] < r (its siblings hold distinct tokens when they come from one node's top-k; a lookup
chain under row 0 may repeat a token of the draft tree's). Row r's logits are the target's
next-token distribution after the path root .. r.

- greedy (`GreedyWalk`): from row 0, descend into the child whose token is the target's
  argmax, as long as there is one; with two such children (a lookup beside a draft node) the
  deeper acceptance wins, the earlier row on a tie. The committed tokens are the path's and then
  the target's argmax after it: exactly AR's tokens.
- sampled (`accept_sampled_tree`): recursive rejection sampling (SpecInfer) with the tree's own
  proposals. A node's children are a deterministic function of the draft (its top-k), so child i's
  proposal is a point mass on its token c_i. At a row with target distribution p, children
  c_1 .. c_m are tried in row order: c_i is accepted with probability p_i(c_i), where p_1 = p and
  p_{i+1} = residual(p_i, c_i) = p_i with c_i's mass removed, renormalised (max(0, p_i - q_i) for
  q_i = the point mass). The first accepted child is descended into; when all are rejected the
  next token is drawn from p_{m+1}, and at a leaf from p (the bonus). Every committed token is then
  an exact draw from the target's warped distribution, whatever the tree (the chi-square test in
  tests/engine/test_domino_tree.py; it fails with the residual left as p).
  Closed form: p_i(c_i) = p(c_i) / (1 - p(c_1) - ... - p(c_{i-1})), so a round reads p at the tree's
  tokens once, and draws the final token from one residual row.
"""

from __future__ import annotations

from typing import Optional

import torch


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

    def path(self, rows: range) -> list[int]:
        """The longest accepted path from row 0 through `rows` only (row 0 not listed; the earlier
        row on a tie): each row's token is the target's choice after its parent's path."""

        def deepest(row: int) -> list[int]:
            best: list[int] = []
            for kid in self.kids[row]:
                if kid in rows and self.proposed[kid] == self.choice[row]:
                    below = deepest(kid)
                    if len(below) + 1 > len(best):
                        best = [kid] + below
            return best

        return deepest(0)


def residual(p: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Target distribution [V], tokens of the rejected children [m] -> p with their mass removed,
    renormalised (each child a point-mass proposal: max(0, p - q) over the point masses)."""
    out = p.index_fill(0, rejected, 0.0) if rejected.numel() else p
    total = out.sum()
    return out / total if float(total) > 0 else p


def accept_sampled_tree(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                        generator: Optional[torch.Generator]) -> tuple[list[int], list[int], int]:
    """tokens [T], parent rows [T], the target's warped probabilities [T, V] -> (accepted path's
    rows, row 0 first; their tokens, row 0's left out; the next token), by recursive rejection
    sampling (module docstring)."""
    T = probs.shape[0]
    at_parent = probs[parents[1:T].to(torch.long), tokens[1:T].to(torch.long)] if T > 1 else probs.new_zeros(0)
    host = torch.cat([tokens[:T].to(probs.dtype), parents[:T].to(probs.dtype), probs.new_zeros(1), at_parent]).tolist()
    proposed = [int(t) for t in host[:T]]
    kids = children_of([int(p) for p in host[T:2 * T]])
    p_at = host[2 * T:]  # p_at[r]: the target's p(tokens[r]) at r's parent (row 0: unused)
    draws = torch.rand(T, generator=generator, device=probs.device, dtype=torch.float64).tolist()  # one per row
    row, path = 0, [0]
    while True:
        removed, taken, seen = 0.0, None, set()
        for kid in kids[row]:
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
    rejected = torch.tensor([proposed[k] for k in kids[row]], dtype=torch.long, device=probs.device)
    dist = residual(probs[row], rejected)
    return path, [proposed[r] for r in path[1:]], int(torch.multinomial(dist[None], 1, generator=generator)[0, 0])
