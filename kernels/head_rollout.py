"""The Domino head's greedy rollout of one block: K sequential steps, tokens kept on the device.

Inputs: z [K, H] (normed draft states of slots 0..K-1; slot j predicts d_{j+1}), base logits
u = lm_head(z) [K, V], the last committed token x_start [1]. Slots j < P (pure_draft_prefix_len)
take argmax u_j; slot j >= P takes
    d_{j+1} = argmax( u_j + W2 · SiLU(W1 · [z_j ; s_j]) )     s_j = GRU state after [x_start, d_1..d_j]
(the model's `rollout`; engine.rollout's torch path, step for step).

The kernel path per step: W1 · [z_j ; s_j] = z_proj[j] + W1_s · s_j (z_proj = z · W1_zᵀ for all K
slots in one GEMM before the loop; W1_s · s_j is a cuBLAS GEMV) -> `correction_argmax` (SiLU, W2,
+u_j, split-vocabulary argmax; 2 launches) -> `gru_cell` (table gather or GEMV + gates; 1 launch)
reading d_{j+1} from the device buffer the argmax wrote. No host sync anywhere, and every shape
is fixed by (K, pool size), so one call can be captured whole in a CUDA graph.

Order: reference (plain torch, the ops the engine's torch path runs), launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from dominospec.kernels.correction_argmax import Argmax, correction_argmax
from dominospec.kernels.gru_cell import GruWeights, gru_cell, gru_weights

# ---- reference --------------------------------------------------------------------------------


@dataclass
class HeadChain:
    """tokens [K] long (d_1..d_K); confidence [K] fp32 (q_j(d_j), softmax of the scored logits) or None."""

    tokens: torch.Tensor
    confidence: Optional[torch.Tensor]


def head_rollout_reference(embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, w1: torch.Tensor,
                           w2: torch.Tensor, pure_draft_prefix_len: int, z: torch.Tensor, base_logits: torch.Tensor,
                           x_start: torch.Tensor, pool_ids: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """E [V, H], W_ih [3G, H], W_hh [3G, G], W1 [r, H+G], W2 [V, r], z [K, H], u [K, V], x_start [1]
    -> (tokens [K], the scored logits of every step: [V], or [M] over `pool_ids` for j >= P).

    Plain torch ops in the weights' dtype, no host sync: the eager baseline, and capturable as is.
    """
    K = z.shape[0]
    state = torch.gru_cell(embed[x_start].to(w_ih.dtype), w_hh.new_zeros(1, w_hh.shape[1]), w_ih, w_hh)  # s_0 [1, G]
    if pool_ids is not None:
        w2, scored_base = w2[pool_ids], base_logits[:, pool_ids]  # [M, r], [K, M]
    tokens, scored = [], []
    for j in range(K):
        if j < pure_draft_prefix_len:
            logits, ids = base_logits[j], None
        else:
            mid = F.silu(F.linear(torch.cat([z[j], state[0]]), w1))  # [r]
            base = base_logits[j] if pool_ids is None else scored_base[j]
            logits, ids = base + F.linear(mid, w2), pool_ids  # [V] or [M]
        pos = logits.argmax()
        token = pos if ids is None else ids.gather(0, pos.reshape(1))[0]  # not ids[pos]: a 0-d index syncs
        tokens.append(token)
        scored.append(logits)
        if j + 1 < K:
            state = torch.gru_cell(embed[token.reshape(1)].to(w_ih.dtype), state, w_ih, w_hh)  # s_{j+1}
    return torch.stack(tokens), scored


# ---- launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadWeights:
    """The head prepared once for the kernels: GRU (table or GEMV), W1 split at H, W2."""

    gru: GruWeights
    w1_z: torch.Tensor  # [r, H]: W1[:, :H], applied to z
    w1_s: torch.Tensor  # [r, G]: W1[:, H:], applied to the GRU state
    w2: torch.Tensor  # [V, r]
    pure_draft_prefix_len: int


def head_weights(embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 pure_draft_prefix_len: int, table_budget_bytes: int) -> HeadWeights:
    """E [V, H], W_ih [3G, H], W_hh [3G, G], W1 [r, H+G], W2 [V, r] -> HeadWeights (see `gru_weights` for the budget)."""
    H = w_ih.shape[1]
    w1 = w1.detach()
    return HeadWeights(gru=gru_weights(embed, w_ih, w_hh, table_budget_bytes), w1_z=w1[:, :H].contiguous(),
                       w1_s=w1[:, H:].contiguous(), w2=w2.detach().contiguous(),
                       pure_draft_prefix_len=int(pure_draft_prefix_len))


def head_rollout(weights: HeadWeights, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                 pool_ids: Optional[torch.Tensor] = None, confidence: bool = False,
                 block_v: Optional[int] = None) -> HeadChain:
    """z [K, H], u [K, V] (last dim contiguous), x_start [1] (long, on device), pool ids [M] or None
    -> HeadChain (greedy). Same tokens as `head_rollout_reference` up to fp32 summation order.
    block_v: the W2 kernel's columns per program (None: `scoring_blocks`)."""
    K = z.shape[0]
    G = weights.gru.w_hh.shape[1]
    P = weights.pure_draft_prefix_len
    device = z.device
    tokens = torch.empty(K + 1, dtype=torch.long, device=device)  # [x_start, d_1..d_K]
    tokens[:1].copy_(x_start.reshape(1))
    states = torch.empty(K + 1, G, dtype=weights.gru.w_hh.dtype, device=device)  # states[i + 1] consumed tokens[0..i]
    states[0].zero_()
    best = torch.empty(K, dtype=torch.float32, device=device)
    lse = torch.empty_like(best)
    gru_cell(tokens[0:1], states[0:1], weights.gru, out=states[1:2])  # s_0
    z_proj = F.linear(z.to(weights.w1_z.dtype), weights.w1_z)  # [K, r], all slots in one GEMM
    for j in range(K):
        if j < P:  # pure draft slot: base logits over the full vocabulary
            row = base_logits[j]
            tokens[j + 1].copy_(row.argmax())
            if confidence:
                best[j], lse[j] = row.float().max(), torch.logsumexp(row.float(), 0)
        else:
            h = torch.addmv(z_proj[j], weights.w1_s, states[j + 1])[None]  # W1 · [z_j ; s_j], [1, r]
            correction_argmax(h, weights.w2, base_logits[j:j + 1], pool_ids,
                              out=Argmax(tokens[j + 1:j + 2], best[j:j + 1], lse[j:j + 1]), block_v=block_v)
        if j + 1 < K:
            gru_cell(tokens[j + 1:j + 2], states[j + 1:j + 2], weights.gru, out=states[j + 2:j + 3])  # s_{j+1}
    return HeadChain(tokens[1:], torch.exp(best - lse) if confidence else None)
