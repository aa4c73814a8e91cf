"""Sampled scoring of one Domino step (temperature > 0): the corrected logits row and its logsumexp.

    logits[c] = base[v_c] + Σ_k SiLU(h[k]) · W2[v_c, k]     (v_c = c, or ids[c] in a candidate pool)
    lse       = logsumexp_c(logits[c] / T)

Lossless speculative sampling needs q, the exact distribution each draft was drawn from. The
kernel returns what q is computed from: the full fp32 row (the engine applies its own
temperature / top-k / top-p warping to it, the same code the torch path runs) and the
logsumexp at temperature T from split-vocabulary pieces, so that without top-k / top-p
q(c) = exp(logits[c] / T - lse) needs no second pass over the row.

Order: reference, kernel, launcher. The per-column math is `corrected_tile` of correction_argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from dominospec.kernels.correction_argmax import corrected_logits_reference, corrected_tile, scoring_plan


@dataclass
class CorrectedLogits:
    """logits [N, C] fp32 (C = V, or M in a pool); lse [N] fp32 = logsumexp(logits / temperature)."""

    logits: torch.Tensor
    lse: torch.Tensor


# ---- reference --------------------------------------------------------------------------------


def correction_logits_reference(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor,
                                ids: Optional[torch.Tensor] = None, temperature: float = 1.0) -> CorrectedLogits:
    """h [N, r], W2 [V, r], base [N, V], ids [M] or None -> CorrectedLogits at `temperature` (> 0)."""
    logits = corrected_logits_reference(h, w2, base, ids)
    return CorrectedLogits(logits, torch.logsumexp(logits / temperature, dim=-1))


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def _correction_logits_kernel(
    h_ptr, w2_ptr, base_ptr, ids_ptr, logits_ptr, part_max_ptr, part_sum_ptr,
    n_cols, r, stride_h, stride_w2, stride_base, stride_logits, n_blocks, inv_temperature,
    POOL: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (n_blocks, N): writes logits[n, block b] and part_*[n, b] = (max, Σ exp(x - max)) of x = logits / T."""
    blk = tl.program_id(0)
    row = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < n_cols
    logits, _ = corrected_tile(h_ptr + row * stride_h, w2_ptr, base_ptr + row * stride_base, ids_ptr,
                               offs, mask, r, stride_w2, POOL, BLOCK_V, BLOCK_R)
    tl.store(logits_ptr + row * stride_logits + offs, logits, mask=mask)
    scaled = logits * inv_temperature  # -inf stays -inf
    best = tl.max(scaled, axis=0)
    tl.store(part_max_ptr + row * n_blocks + blk, best)
    tl.store(part_sum_ptr + row * n_blocks + blk, tl.sum(tl.exp(scaled - best), axis=0))


# ---- launcher ---------------------------------------------------------------------------------


def correction_logits(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor, ids: Optional[torch.Tensor] = None,
                      temperature: float = 1.0, block_v: Optional[int] = None,
                      block_r: Optional[int] = None) -> CorrectedLogits:
    """h [N, r] (pre-SiLU), W2 [V, r], base logits [N, V], pool ids [M] or None -> CorrectedLogits."""
    if not temperature > 0:
        raise ValueError(f"correction_logits needs temperature > 0, got {temperature}")
    plan = scoring_plan(h, w2, base, ids, block_v, block_r)
    N, r = h.shape
    C, n_blocks = plan.n_cols, plan.n_blocks
    logits = torch.empty(N, C, dtype=torch.float32, device=h.device)
    part_max = torch.empty(N, n_blocks, dtype=torch.float32, device=h.device)
    part_sum = torch.empty_like(part_max)
    pool = ids is not None
    _correction_logits_kernel[(n_blocks, N)](
        h, w2, base, ids if pool else logits, logits, part_max, part_sum,
        C, r, h.stride(0), w2.stride(0), base.stride(0), logits.stride(0), n_blocks, 1.0 / temperature,
        POOL=pool, BLOCK_V=plan.block_v, BLOCK_R=plan.block_r,
    )
    # lse = M + log Σ_b s_b · exp(m_b - M): n_blocks numbers per row, combined in torch
    lse = torch.logsumexp(part_max + part_sum.log(), dim=-1)
    return CorrectedLogits(logits, lse)
