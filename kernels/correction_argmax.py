"""Greedy scoring of one Domino step: argmax over u + W2 · SiLU(h), split over the vocabulary.

    logits[v] = base[v] + Σ_k SiLU(h[k]) · W2[v, k]        h = W1 · [z ; s]  [N, r],  W2 [V, r]
    token     = argmax_v logits[v]   (ties: the lowest index, as torch.argmax)

Two kernels, no [N, V] logits tensor in memory:
1. partials, grid (cdiv(C, BLOCK_V), N): each program scores BLOCK_V columns, streaming its W2
   rows once (W2 is ~70% of the head's bytes: 78 MB in bf16 at Qwen3-8B shapes), and writes its
   max, the column of the first max, and Σ exp(logit - max);
2. reduce, grid (N,): the first block holding the global max gives the token (blocks are in
   column order, so this is the lowest index), and the pieces give logsumexp, from which the
   draft's confidence q(d) = exp(max - lse) follows without a softmax pass.
Candidate pool (SGLang's `--speculative-domino-candidate-pool-size`): `ids` [M] restricts the
columns to those vocabulary ids, read straight from W2 and the base row (no gathered copy);
the token is ids[first position of the max], as torch's `ids[argmax(scored)]`.
Block sizes default to `scoring_blocks` (measured on an H200).

Order: reference, kernels, launchers. Arithmetic is fp32 whatever the storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# ---- reference --------------------------------------------------------------------------------


def corrected_logits_reference(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor,
                               ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [N, r], W2 [V, r], base [N, V], ids [M] or None -> fp32 logits [N, C] (C = M or V)."""
    if ids is not None:
        w2, base = w2[ids], base[:, ids]
    return base.float() + F.silu(h.float()) @ w2.float().t()


@dataclass
class Argmax:
    """token [N] long (vocabulary id), best [N] fp32 (its logit), lse [N] fp32 (logsumexp of the scored logits)."""

    token: torch.Tensor
    best: torch.Tensor
    lse: torch.Tensor


def correction_argmax_reference(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor,
                                ids: Optional[torch.Tensor] = None) -> Argmax:
    """h [N, r], W2 [V, r], base [N, V], ids [M] or None -> Argmax over the corrected logits."""
    logits = corrected_logits_reference(h, w2, base, ids)  # [N, C]
    best = logits.max(dim=-1).values
    pos = logits.argmax(dim=-1)  # the first maximum
    token = pos if ids is None else ids[pos]
    return Argmax(token, best, torch.logsumexp(logits, dim=-1))


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def corrected_tile(h_ptr, w2_ptr, base_ptr, ids_ptr, offs, mask, r, stride_w2,
                   POOL: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Columns `offs` [BLOCK_V] of one row -> (fp32 logits, -inf where masked; their vocabulary ids, int64).

    h_ptr and base_ptr point at the row. Column c is vocabulary id c, or ids[c] in a pool.
    """
    if POOL:
        vocab = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
    else:
        vocab = offs.to(tl.int64)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for k0 in range(0, r, BLOCK_R):
        offs_k = k0 + tl.arange(0, BLOCK_R)
        mask_k = offs_k < r
        h = tl.load(h_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        mid = h * tl.sigmoid(h)  # SiLU, [BLOCK_R]; masked lanes are 0
        w = tl.load(w2_ptr + vocab[:, None] * stride_w2 + offs_k[None, :],
                    mask=mask[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_R]
        acc += tl.sum(w * mid[None, :], axis=1)
    base = tl.load(base_ptr + vocab, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, acc + base, float("-inf")), vocab


@triton.jit
def _correction_argmax_partials_kernel(
    h_ptr, w2_ptr, base_ptr, ids_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr,
    n_cols, r, stride_h, stride_w2, stride_base, n_blocks,
    POOL: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (n_blocks, N): block b of row n -> part_*[n, b] = (max, id of the first max, Σ exp(x - max))."""
    blk = tl.program_id(0)
    row = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_V)
    offs = blk * BLOCK_V + lanes
    mask = offs < n_cols
    logits, vocab = corrected_tile(h_ptr + row * stride_h, w2_ptr, base_ptr + row * stride_base, ids_ptr,
                                   offs, mask, r, stride_w2, POOL, BLOCK_V, BLOCK_R)
    best = tl.max(logits, axis=0)
    first = tl.argmax(logits, axis=0, tie_break_left=True)
    token = tl.sum(tl.where(lanes == first, vocab, 0), axis=0)  # vocab[first]
    total = tl.sum(tl.exp(logits - best), axis=0)  # masked lanes: exp(-inf) = 0
    out = row * n_blocks + blk
    tl.store(part_max_ptr + out, best)
    tl.store(part_idx_ptr + out, token)
    tl.store(part_sum_ptr + out, total)


@triton.jit
def _argmax_reduce_kernel(part_max_ptr, part_idx_ptr, part_sum_ptr, token_ptr, best_ptr, lse_ptr, n_blocks,
                          BLOCK_B: tl.constexpr):
    """Grid (N,): row n's partials -> token[n], best[n], lse[n]."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    mask = offs < n_blocks
    maxes = tl.load(part_max_ptr + row * n_blocks + offs, mask=mask, other=float("-inf"))
    best = tl.max(maxes, axis=0)
    first = tl.argmax(maxes, axis=0, tie_break_left=True)  # lowest block = lowest column among ties
    sums = tl.load(part_sum_ptr + row * n_blocks + offs, mask=mask, other=0.0)
    total = tl.sum(tl.where(mask, sums * tl.exp(maxes - best), 0.0), axis=0)
    tl.store(token_ptr + row, tl.load(part_idx_ptr + row * n_blocks + first))
    tl.store(best_ptr + row, best)
    tl.store(lse_ptr + row, best + tl.log(total))


# ---- launchers --------------------------------------------------------------------------------


def check_scoring_inputs(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor, ids: Optional[torch.Tensor]) -> int:
    """Shapes and strides the scoring kernels assume -> C, the number of scored columns."""
    N, r = h.shape
    V = w2.shape[0]
    assert w2.shape[1] == r and base.shape == (N, V), (tuple(h.shape), tuple(w2.shape), tuple(base.shape))
    assert h.stride(-1) == 1 and w2.stride(-1) == 1 and base.stride(-1) == 1, "last dimensions must be contiguous"
    if ids is not None:
        assert ids.dim() == 1 and ids.is_contiguous()
        return ids.numel()
    return V


def scoring_blocks(n_cols: int, r: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_R) for C scored columns of rank r, from an H200 sweep (bf16, r = 256, inside a
    CUDA graph): full vocabulary [128, 128] tiles, near the bandwidth of W2; a 2048-id pool needs
    more programs than its 16 tiles of 128, so [16, 256] (whole 512 B rows). The times are in
    docs/kernels.md and the journal."""
    if n_cols <= 16384:
        return 16, min(256, triton.next_power_of_2(r))
    return 128, min(128, triton.next_power_of_2(r))


@dataclass(frozen=True)
class ScoringPlan:
    """How a scoring launch tiles its C columns: BLOCK_V x BLOCK_R tiles, n_blocks partials per row."""

    n_cols: int
    block_v: int
    block_r: int
    n_blocks: int


def scoring_plan(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor, ids: Optional[torch.Tensor],
                 block_v: Optional[int], block_r: Optional[int]) -> ScoringPlan:
    """Checked inputs + optional block overrides -> the launch's tiling (defaults: `scoring_blocks`)."""
    C = check_scoring_inputs(h, w2, base, ids)
    default_v, default_r = scoring_blocks(C, h.shape[1])
    block_v = block_v or default_v
    return ScoringPlan(C, block_v, block_r or default_r, triton.cdiv(C, block_v))


def correction_argmax(h: torch.Tensor, w2: torch.Tensor, base: torch.Tensor, ids: Optional[torch.Tensor] = None,
                      out: Optional[Argmax] = None, block_v: Optional[int] = None,
                      block_r: Optional[int] = None) -> Argmax:
    """h [N, r] (pre-SiLU), W2 [V, r], base logits [N, V], pool ids [M] or None -> Argmax [N].

    `out` (optional) receives the result in place: e.g. token = a slot of a rollout's device-side
    token buffer, so the next GRU step reads it without a host sync.
    """
    plan = scoring_plan(h, w2, base, ids, block_v, block_r)
    N, r = h.shape
    n_blocks = plan.n_blocks
    part_max = torch.empty(N, n_blocks, dtype=torch.float32, device=h.device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(N, n_blocks, dtype=torch.int64, device=h.device)
    if out is None:
        out = Argmax(torch.empty(N, dtype=torch.int64, device=h.device),
                     torch.empty(N, dtype=torch.float32, device=h.device),
                     torch.empty(N, dtype=torch.float32, device=h.device))
    pool = ids is not None
    _correction_argmax_partials_kernel[(n_blocks, N)](
        h, w2, base, ids if pool else part_idx, part_max, part_idx, part_sum,
        plan.n_cols, r, h.stride(0), w2.stride(0), base.stride(0), n_blocks,
        POOL=pool, BLOCK_V=plan.block_v, BLOCK_R=plan.block_r,
    )
    _argmax_reduce_kernel[(N,)](part_max, part_idx, part_sum, out.token, out.best, out.lse, n_blocks,
                                BLOCK_B=triton.next_power_of_2(n_blocks))
    return out
