"""One decode step of B independent sequences, each over its own cached columns only, one launch.

Cache layout k_cache, v_cache [S, Hkv, C, D] (S >= B slots; row b of the step is slot b): slot b
holds its sequence's keys and values in columns 0 .. seen[b]-1, this step's token included (already
written); columns past seen[b] are never read. `seen` [B] is a device tensor read by the kernel, so
the grid and the launch depend on (B, heads) only (a captured graph replays for any lengths), while
each row's loop stops at its own length: the step's cost follows what the rows hold, not the
capacity C nor the longest row. Grouped-query heads: q head h reads kv head h // (Hq/Hkv).

    out[b, h] = softmax(q[b, h] · K[b, kv(h), :seen[b]]ᵀ · scale) · V[b, kv(h), :seen[b]]

Kernel: program (row, kv head) stacks the G = Hq/Hkv query heads sharing that kv head as its M
dimension (padded to BLOCK_M = 16, tl.dot's smallest), streams the row's columns in blocks of
BLOCK_N with an online softmax in fp32 (exp2 domain): whole blocks unmasked, the last partial one
masked. B·Hkv programs: 3,072 at SmolLM2's 3 kv heads and 1,024 rows, more than an H100's SMs hold
at once, so no split of the column range is needed. A column block is `tree_attention`'s
(`_attend_block`, with the whole row as context: start = end = seen, so no mask word is read), and
so is its arithmetic: q·Kᵀ on tl.dot from the storage dtype with fp32 accumulation, P rounded to
the storage dtype for P·V; under TRITON_INTERPRET=1 the dot operands are widened to fp32 first.

Order: reference, kernel, launcher.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from dominospec.kernels.tree_attention import _attend_block, _block_d, _store_out

BLOCK_M = 16  # query heads of one kv head, padded: tl.dot's smallest M
BLOCK_N = 64  # cache columns a block (a guess, not yet swept on a GPU: benchmarks/regenerate_static.py --attention rows:N:W)
NUM_WARPS = 4

# ---- reference --------------------------------------------------------------------------------


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seen: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [B, Hq, D], caches [S, Hkv, C, D] (S >= B), seen [B] long (1 <= seen <= C) -> out [B, Hq, D] (q's dtype).

    Plain math, one row at a time over its own seen[b] columns, in fp32 (fp64 for fp64 inputs)."""
    B, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for b, n in enumerate(seen.tolist()):
        k = k_cache[b, :, :n].to(acc).repeat_interleave(G, dim=0)  # [Hq, n, D]
        v = v_cache[b, :, :n].to(acc).repeat_interleave(G, dim=0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].to(acc), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", p, v).to(q.dtype)
    return out


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, seen_ptr, G, qk_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_kc, stride_vs, stride_vh, stride_vc, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Grid (B, Hkv): program (row b, kv head) owns query heads kvh·G .. kvh·G+G-1 of row b and reads
    columns 0 .. seen[b]-1 of slot b."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < G
    h = kvh * G + offs_m  # q head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D], storage dtype
    if DOT_FP32:
        q = q.to(tl.float32)
    seen = tl.load(seen_ptr + b).to(tl.int64)
    k_base = k_ptr + b * stride_ks + kvh * stride_kh
    v_base = v_ptr + b * stride_vs + kvh * stride_vh
    no_words = seen_ptr + 0 * offs_m  # [BLOCK_M] pointers never read: every column is context (< start = seen)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    full_end = (seen // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):  # whole blocks: no mask
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, no_words, mask_m, k_base, v_base, n0, seen, seen, stride_kc,
                                      stride_vc, qk_scale, offs_d, mask_d, BLOCK_N, False, D != BLOCK_D, DOT_FP32)
    if full_end < seen:  # the last partial block: columns >= seen are not loaded and score -inf
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, no_words, mask_m, k_base, v_base, full_end, seen, seen,
                                      stride_kc, stride_vc, qk_scale, offs_d, mask_d, BLOCK_N, True, D != BLOCK_D,
                                      DOT_FP32)
    _store_out(out_ptr + b * stride_ob + h[:, None] * stride_oh + offs_d[None, :], acc, l_i, mask_m, mask_d)


# ---- launcher ---------------------------------------------------------------------------------


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seen: torch.Tensor,
                     scale: float, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """q [B, Hq, D], caches [S, Hkv, C, D] (S >= B), seen [B] long on the device (1 <= seen[b] <= C, not
    checked: no host read) -> out [B, Hq, D] in q's dtype (contiguous). One launch, grid (B, Hkv), no host
    sync; block_n (a power of two >= 16) columns a block, num_warps a program."""
    B, Hq, D = q.shape
    S, Hkv, C, Dk = k_cache.shape
    assert S >= B and Hq % Hkv == 0 and Hq // Hkv <= BLOCK_M and Dk == D and v_cache.shape == k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype and seen.shape == (B,)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(B, Hkv)](
        q, k_cache, v_cache, out, seen, Hq // Hkv, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        D=D, BLOCK_D=_block_d(D), BLOCK_M=BLOCK_M, BLOCK_N=block_n, DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps,
    )
    return out
