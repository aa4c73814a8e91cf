"""The Domino head's greedy rollout of W branches of one block (a draft tree), on device, no host sync.

Inputs as `head_rollout`: z [K, H], base logits u [K, V], x_start [1]; plus the branches' first
tokens first [W] (engine.draft_head: the W most likely tokens of u_0, best first). Branch w is

    d^w_1 = first[w];   d^w_{j+1} = argmax u_j          (pure draft slots, 1 <= j < P)
    d^w_{j+1} = argmax( u_j + W2 · SiLU(W1 · [z_j ; s^w_j]) )   (j >= P)
    s^w_j = GRU state after [x_start, d^w_1 .. d^w_j]

so the head corrects every branch for the prefix it has (engine.draft_head). The W branches step as
W rows of the existing kernels, four launches a step: W1_s · s for all rows in one GEMM, the two
scoring launches of `correction_argmax` (split vocabulary, or the pool's M ids), and `gru_cell`
on W rows. Every shape is fixed by (K, W, pool size) and nothing reads a value on the host, so the
whole rollout captures into one CUDA graph (engine.head_kernels.RolloutGraphs.branches): a
step then costs one replay's share instead of the eager ops' launches from Python.

Ties go to the lowest column (torch.argmax; in a pool the lowest pool position). Arithmetic is fp32
in the kernels; states are stored in the GRU's dtype, as the reference rounds them.

The torch reference is the model's `rollout` with `first` (models/domino; tests/kernels compare against it).
The kernels are gru_cell's and correction_argmax's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dominospec.kernels.correction_argmax import Argmax, correction_argmax
from dominospec.kernels.gru_cell import gru_cell
from dominospec.kernels.head_rollout import HeadWeights

# ---- launcher ---------------------------------------------------------------------------------


def head_branches(weights: HeadWeights, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                  first: torch.Tensor, pool_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """z [K, H], u [K, V] (last dim contiguous), x_start [1], first [W] (long, on device), pool ids [M]
    or None -> tokens [W, K] (long; a transposed view of a [K, W] buffer). The same tokens as
    the model's `rollout(first=...)` up to fp32 summation order; W = 1 is `head_rollout`'s chain."""
    K, W, P = z.shape[0], first.numel(), weights.pure_draft_prefix_len
    gru = weights.gru
    G = gru.w_hh.shape[1]
    slots = torch.empty(K, W, dtype=torch.long, device=z.device)  # row j: slot j of every branch (contiguous)
    slots[0] = first
    if P > 1:
        slots[1:P] = base_logits[1:P].float().argmax(-1, keepdim=True)  # pure draft slots: the same in every branch
    state = gru_cell(x_start.reshape(1), gru.w_hh.new_zeros(1, G), gru)  # s_0 [1, G]
    state = gru_cell(slots[0], state.expand(W, G), gru)  # s_1 [W, G]: each branch's first token consumed
    z_proj = F.linear(z.to(weights.w1_z.dtype), weights.w1_z)  # [K, r], all slots in one GEMM
    best = torch.empty(K, W, dtype=torch.float32, device=z.device)
    lse = torch.empty_like(best)
    for j in range(1, K):
        if j >= P:
            h = torch.addmm(z_proj[j], state.to(weights.w1_s_t.dtype), weights.w1_s_t)  # W1 · [z_j ; s^w_j], [W, r]
            correction_argmax(h, weights.w2, base_logits[j].expand(W, -1), pool_ids,
                              out=Argmax(slots[j], best[j], lse[j]))
        if j + 1 < K:
            state = gru_cell(slots[j], state, gru)  # s_{j+1} [W, G]
    return slots.t()
