"""A fork round: the draft's chain and a prompt lookup verified together, in one target forward.

Prompt lookup and the draft win on different stretches: a lookup on text that repeats the
prompt or itself (code, lists, quotes), the draft elsewhere. A round that has both does not have
to choose: it verifies a tree of two branches that share the round's first row, and keeps the
one the target accepts further. On a CPU a verify of 11 rows costs about what one of 4 does
(the forward streams the same weights), so the second branch is nearly free.

The verify rows, T = 1 + K_d + K_l (`fork_tree`):

    row 0                x_start            position start
    rows 1 .. K_d        d_1 .. d_{K_d}     positions start+1 .. start+K_d      (the draft's chain)
    rows K_d+1 .. T-1    l_1 .. l_{K_l}     positions start+1 .. start+K_l      (the lookup)

Each row attends to the committed context, to row 0, and to the rows before it in its own
branch, never to the other branch: each branch's logits and features are those a chain of its
own would get (up to the rounding of a wider forward). A chain is the tree of one branch
(`chain_tree`).

Greedy acceptance on each branch (`accept_fork`) commits the target's own greedy tokens, so the
branches agree on every token both accept, and the one that accepts more wins (a tie goes to the
draft, whose rows are already in place). The target KV and the features then keep row 0 and the
winner's rows (`Forked.rows`): the runner moves them into place (`select`) before the crop.
Greedy only: under sampling, two proposals for one position need multi-draft rejection (as in
SpecInfer), which the engine does not do; a sampled round verifies one branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dominospec.engine.sampling import accept_greedy


@dataclass(frozen=True)
class Tree:
    """The shape of a verify forward of T rows: depth [T] long (position = start + depth), and
    visible [T, T] bool (visible[i, j]: row i attends to row j; always visible[i, i])."""

    depth: torch.Tensor
    visible: torch.Tensor


def chain_tree(T: int, device: torch.device) -> Tree:
    """T rows of one chain: row i at depth i, seeing rows 0..i (the causal mask)."""
    return Tree(torch.arange(T, device=device), torch.ones(T, T, dtype=torch.bool, device=device).tril())


def fork_tree(kd: int, kl: int, device: torch.device) -> Tree:
    """Row 0, a branch of kd rows, then a branch of kl rows (module docstring) -> their Tree."""
    T = 1 + kd + kl
    branch = torch.zeros(T, dtype=torch.long)  # 0: row 0 (shared), 1: the chain, 2: the lookup
    branch[1:1 + kd], branch[1 + kd:] = 1, 2
    depth = torch.cat([torch.arange(kd + 1), torch.arange(1, kl + 1)])
    rows = torch.arange(T)
    same = (branch[:, None] == branch[None, :]) & (rows[None, :] <= rows[:, None])
    visible = same | (rows[None, :] == 0)  # every row sees row 0
    return Tree(depth.to(device), visible.to(device))


@dataclass(frozen=True)
class Forked:
    """What a greedy fork round accepted: per branch, and the winner's."""

    accepted_draft: int  # n_d: the draft's chain tokens the target accepted
    accepted_lookup: int  # n_l: the lookup's
    lookup_won: bool  # the lookup accepted more (its rows must move into place)
    accepted: int  # n = max(n_d, n_l)
    next_token: int  # the target's token after the winner's n accepted ones
    rows: list[int]  # [n + 1]: verify rows of x_start and the winner's accepted tokens, in order


def accept_fork(chain: torch.Tensor, lookup: torch.Tensor, logits: torch.Tensor) -> Forked:
    """Drafts [K_d], lookup [K_l], verify logits [1 + K_d + K_l, V] in fork_tree's row order -> Forked."""
    kd = chain.shape[0]
    n_d, next_d = accept_greedy(chain, logits[:kd + 1])
    lookup_rows = [0] + list(range(kd + 1, kd + 1 + lookup.shape[0]))
    n_l, next_l = accept_greedy(lookup, logits[lookup_rows])
    if n_l > n_d:
        return Forked(n_d, n_l, True, n_l, next_l, lookup_rows[:n_l + 1])
    return Forked(n_d, n_l, False, n_d, next_d, list(range(n_d + 1)))
