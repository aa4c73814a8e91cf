"""Fused GRU cell of the Domino head: token id (on device) + state -> next state, one launch.

The head's GRU is bias-free, PyTorch gate order r, z, n (weight_ih_l0 [3G, H], weight_hh_l0 [3G, G]):
    gi = W_ih . E[token]            gh = W_hh . s                      (each [3G])
    r = σ(gi_r + gh_r)   z = σ(gi_z + gh_z)   n = tanh(gi_n + r · gh_n)
    s' = (1 - z) · n + z · s
gi comes from one of two places, chosen once per draft by a memory budget (`gru_weights`):
- table: T = E · W_ihᵀ [V, 3G] precomputed, gi = T[token] (a 3G-row gather; Qwen3-8B shapes:
  151936 × 3072 bf16 ≈ 0.93 GB, and W_ih's 25 MB per step are no longer streamed);
- GEMV: gi = W_ih . E[token] inside the kernel (reads E's row and all of W_ih).
The token is read from device memory, so a rollout never syncs with the host between steps.

Order: reference, kernel, launcher. Arithmetic is fp32 whatever the storage dtype; s' is stored
in the state's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

# ---- reference --------------------------------------------------------------------------------


def gru_cell_reference(token: torch.Tensor, state: torch.Tensor, w_hh: torch.Tensor,
                       table: Optional[torch.Tensor] = None, embed: Optional[torch.Tensor] = None,
                       w_ih: Optional[torch.Tensor] = None) -> torch.Tensor:
    """token [N] (long), state [N, G] -> next state [N, G] (state's dtype), in fp32 arithmetic.

    gi from `table` [V, 3G] when given, else from `embed` [V, H] and `w_ih` [3G, H].
    """
    if table is not None:
        gi = table[token].float()  # [N, 3G]
    else:
        gi = embed[token].float() @ w_ih.float().t()  # [N, H] x [H, 3G]
    s = state.float()
    gh = s @ w_hh.float().t()  # [N, 3G]
    gi_r, gi_z, gi_n = gi.chunk(3, dim=-1)
    gh_r, gh_z, gh_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(gi_r + gh_r)
    z = torch.sigmoid(gi_z + gh_z)
    n = torch.tanh(gi_n + r * gh_n)
    return ((1 - z) * n + z * s).to(state.dtype)


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def gru_update(gi_r, gi_z, gi_n, gh_r, gh_z, gh_n, s):
    """The cell's gates in fp32 from the input gates gi and gh = W_hh · s (each r, z, n) and the state
    s -> s' = (1 - z) · n + z · s, unrounded. Every kernel that steps the GRU calls this."""
    r = tl.sigmoid(gi_r + gh_r)
    z = tl.sigmoid(gi_z + gh_z)
    n = 2.0 * tl.sigmoid(2.0 * (gi_n + r * gh_n)) - 1.0  # tanh(x) = 2σ(2x) - 1
    return (1.0 - z) * n + z * s


@triton.jit
def _gate_gemv(w_ptr, x_ptr, offs_g, mask_g, G, K, stride_w, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [3G, K] . x [K] for the r, z, n rows of this tile -> three fp32 [BLOCK_G]."""
    acc_r = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_n = tl.zeros([BLOCK_G], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_K]
        tile = offs_g[:, None] * stride_w + offs_k[None, :]  # rows g, G + g, 2G + g of W
        mask = mask_g[:, None] & mask_k[None, :]
        acc_r += tl.sum(tl.load(w_ptr + tile, mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        acc_z += tl.sum(tl.load(w_ptr + G * stride_w + tile, mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        acc_n += tl.sum(tl.load(w_ptr + 2 * G * stride_w + tile, mask=mask, other=0.0).to(tl.float32) * x, axis=1)
    return acc_r, acc_z, acc_n


@triton.jit
def _gru_cell_fwd_kernel(
    token_ptr, table_ptr, embed_ptr, w_ih_ptr, state_ptr, w_hh_ptr, out_ptr,
    G, H, stride_table, stride_embed, stride_w_ih, stride_w_hh, stride_state, stride_out,
    USE_TABLE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(G, BLOCK_G), N): program (i, row) writes s'[row, i*BLOCK_G : (i+1)*BLOCK_G]."""
    row = tl.program_id(1)
    offs_g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    token = tl.load(token_ptr + row).to(tl.int64)
    state_row = state_ptr + row * stride_state
    gh_r, gh_z, gh_n = _gate_gemv(w_hh_ptr, state_row, offs_g, mask_g, G, G, stride_w_hh, BLOCK_G, BLOCK_K)
    if USE_TABLE:
        gi_row = table_ptr + token * stride_table
        gi_r = tl.load(gi_row + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        gi_z = tl.load(gi_row + G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        gi_n = tl.load(gi_row + 2 * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    else:
        gi_r, gi_z, gi_n = _gate_gemv(w_ih_ptr, embed_ptr + token * stride_embed, offs_g, mask_g, G, H,
                                      stride_w_ih, BLOCK_G, BLOCK_K)
    s = tl.load(state_row + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    s_next = gru_update(gi_r, gi_z, gi_n, gh_r, gh_z, gh_n, s)
    tl.store(out_ptr + row * stride_out + offs_g, s_next.to(out_ptr.dtype.element_ty), mask=mask_g)


# ---- launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GruWeights:
    """The GRU prepared for `gru_cell`: w_hh [3G, G]; table [V, 3G] or None (then embed [V, H], w_ih [3G, H])."""

    w_hh: torch.Tensor
    embed: torch.Tensor
    w_ih: torch.Tensor
    table: Optional[torch.Tensor]


def gru_table_bytes(vocab_size: int, gru_hidden: int, dtype: torch.dtype) -> int:
    """Size of the precomputed input table [V, 3G] in `dtype`."""
    return vocab_size * 3 * gru_hidden * torch.empty(0, dtype=dtype).element_size()


def gru_weights(embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, table_budget_bytes: int,
                chunk_rows: int = 16384) -> GruWeights:
    """E [V, H], W_ih [3G, H], W_hh [3G, G] -> GruWeights, with the table T = E · W_ihᵀ (in W_ih's
    dtype) when it fits in `table_budget_bytes`, else the GEMV path. Built in row chunks so that E
    is never copied whole into W_ih's dtype."""
    V, G = embed.shape[0], w_hh.shape[1]
    embed, w_ih, w_hh = embed.detach().contiguous(), w_ih.detach().contiguous(), w_hh.detach().contiguous()
    table = None
    if gru_table_bytes(V, G, w_ih.dtype) <= table_budget_bytes:
        table = torch.empty(V, 3 * G, dtype=w_ih.dtype, device=w_ih.device)
        for v0 in range(0, V, chunk_rows):
            torch.matmul(embed[v0:v0 + chunk_rows].to(w_ih.dtype), w_ih.t(), out=table[v0:v0 + chunk_rows])
    return GruWeights(w_hh=w_hh, embed=embed, w_ih=w_ih, table=table)


def gru_cell(token: torch.Tensor, state: torch.Tensor, weights: GruWeights, out: Optional[torch.Tensor] = None,
             block_g: int = 2, block_k: int = 1024) -> torch.Tensor:
    """token [N] (long, on device), state [N, G] -> next state [N, G] in state's dtype (written to `out`).

    No host sync: the token is read by the kernel. `out` must not alias `state` (every program
    reads all of s while others write s'). Default blocks, from an H200 sweep at G = 1024, H = 4096
    (bf16, timed inside a CUDA graph): many thin programs win, the table faster than the GEMV
    (the times are in docs/kernels.md and the journal).
    """
    N, G = state.shape
    H = weights.embed.shape[1]
    if out is None:
        out = torch.empty_like(state)
    assert out.data_ptr() != state.data_ptr(), "gru_cell: out must not alias state"
    assert state.stride(-1) == 1 and out.stride(-1) == 1 and token.numel() == N
    table = weights.table
    use_table = table is not None
    block_k = min(block_k, triton.next_power_of_2(max(G, H)))  # no wider than the longest row
    grid = (triton.cdiv(G, block_g), N)
    _gru_cell_fwd_kernel[grid](
        token, table if use_table else weights.w_hh, weights.embed, weights.w_ih, state, weights.w_hh, out,
        G, H, table.stride(0) if use_table else 0, weights.embed.stride(0), weights.w_ih.stride(0),
        weights.w_hh.stride(0), state.stride(0), out.stride(0),
        USE_TABLE=use_table, BLOCK_G=block_g, BLOCK_K=block_k,
    )
    return out
