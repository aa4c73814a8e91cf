"""Drafting W branches for one block (greedy): the draft's W most likely first tokens, each continued.

The draft's first token is where τ is lost: on the embedded default its best guess is the target's
token 39 % of the time on ShareGPT, and one of its best 4 guesses 58 % of the time
(docs/benchmarks.md, "Draft trees"). So a round may verify the W best first tokens as W branches of
one tree (engine.fork), each drafted on to K tokens:

    branch 0:   c_0 = argmax u_0 (the chain's own d_1), then the chain after it
    branch w:   c_w = the w-th most likely token of u_0 after c_0, then the chain after c_w

Input: z [K, H] and base logits u [K, V] of the block (engine.rollout), x_start [1].
- head off (`dflash`): slot j >= 1 drafts argmax u_j whatever came before it, so every branch
  continues with the same tokens.
- head on (`domino`): slot j >= P (pure_draft_prefix_len) drafts the argmax of u_j + delta_j, delta_j
  from the GRU state of *its own branch* after [x_start, c_w, ...]: the head corrects each branch
  for the prefix it actually has, which is what the head is for. The W branches step as one batch
  of W rows (a step of W rows costs about what one of 1 does on a CPU), over the candidate pool of
  the block (engine.rollout.candidate_pool) when there is one.
Branch 0 with W = 1 is `draft_chain`'s greedy chain (the same ops). Only verification must be exact:
the drafts only decide what is proposed.

Kernel choice (params `engine.head_kernel`), as for the chain (engine.rollout): prepared `HeadWeights`
run the branches on device (`kernels.head_branches`: W rows of the fused kernels, four launches a
step, the pool from `pool_select`), and on static caches `RolloutGraphs.branches` replays that
rollout as one CUDA graph per (K, W): on a GPU the eager ops' launches made a branch step cost 8x
a chain step, so auto-K seldom bought a tree there (docs/benchmarks.md, "Draft trees").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dominospec.engine.rollout import candidate_pool, pooled_head


def first_tokens(u0: torch.Tensor, width: int) -> torch.Tensor:
    """Base logits of slot 0 [V] -> [width] token ids: argmax first (the chain's d_1, ties as argmax
    breaks them), then the next most likely in order."""
    scores = u0.float()
    best = scores.argmax()
    if width == 1:
        return best[None]
    # scatter, not rest[best] = ...: an index_put by a 0-d tensor reads the host, which a CUDA graph's capture refuses
    rest = scores.scatter(0, best.reshape(1), float("-inf"))
    return torch.cat([best[None], rest.topk(width - 1).indices])


def tree_rollout(weights: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, width: int,
                 pool_size: int, workspace: Any = None) -> torch.Tensor:
    """A draft tree on the kernels: z [K, H], u [K, V], x_start [1] -> tokens [W, K], for the head
    prepared as `HeadWeights` (engine.head_kernels). The pool (`pool_select`, on `workspace` when
    given) and the W first tokens are chosen on the device, so the whole call can be captured
    (`RolloutGraphs.branches`)."""
    from dominospec.kernels.head_branches import head_branches
    from dominospec.kernels.pool_select import pool_select

    cand = pool_select(base_logits, weights.pure_draft_prefix_len, pool_size, workspace)  # [M] ascending, or None
    return head_branches(weights, z, base_logits, x_start, first_tokens(base_logits[0], width), cand)


def draft_branches(draft: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, embed_tokens: Any,
                   head: bool, pool_size: int, width: int, kernels: Any = None, graphs: Any = None) -> torch.Tensor:
    """z [K, H], u [K, V], x_start [1] -> drafts [W, K] (long): branch w in row w (module docstring).
    `kernels`: None (torch ops) or the head prepared for the Triton kernels (engine.head_kernels);
    `graphs`: with kernels, their rollouts on static buffers (engine.head_kernels.RolloutGraphs)."""
    if head and graphs is not None:
        return graphs.branches(z, base_logits, x_start, width)
    if head and kernels is not None:
        return tree_rollout(kernels, z, base_logits, x_start, width, pool_size)
    K, V = base_logits.shape
    tokens = torch.empty(width, K, dtype=torch.long, device=base_logits.device)
    tokens[:, 0] = first_tokens(base_logits[0], width)
    if K == 1:
        return tokens
    P = int(draft.config.pure_draft_prefix_len) if head else K  # slots 1..P-1: argmax u_j, the same for every branch
    if P > 1:
        tokens[:, 1:P] = base_logits[1:P].float().argmax(-1)
    if not head:
        return tokens
    cand = candidate_pool(base_logits, P, pool_size)
    w2, scored_base = pooled_head(draft, base_logits, cand)  # [M, r], [K, M] (pool) or [V, r], [K, V]
    zeros = z.new_zeros(1, draft.config.gru_hidden_dim)
    state = draft.gru_step(embed_tokens(x_start), zeros).expand(width, -1)  # s_0 [W, G]: x_start consumed
    state = draft.gru_step(embed_tokens(tokens[:, 0]), state)  # s_1: each branch's first token consumed
    for j in range(1, K):
        if j >= P:  # a corrected slot (pure draft slots were filled above)
            mid = draft.correction_hidden(z[j].expand(width, -1), state)  # [W, r]
            best = (scored_base[j] + F.linear(mid.to(w2.dtype), w2)).float().argmax(-1)  # [W]
            tokens[:, j] = best if cand is None else cand[best]
        if j + 1 < K:
            state = draft.gru_step(embed_tokens(tokens[:, j]), state)
    return tokens
