"""Rotary embedding (+ Qwen3's per-head q/k RMSNorm) and the KV-cache write of one layer, one launch.

qkv [T, (Hq + 2·Hkv)·D] is one matmul's output: Hq query heads, then Hkv key heads, then Hkv value
heads, each head D contiguous. For every row t and head:
    q head:  x -> [q_norm] -> rope -> q_out[t, h]                (q_out [T, Hq, D], contiguous)
    k head:  x -> [k_norm] -> rope -> k_cache[h, slot + t]
    v head:  x ----------------------> v_cache[h, slot + t]
with `slot` read from device memory (a 0-d long tensor), so a CUDA graph replays it for any slot.

The arithmetic is HF's eager ops in the storage dtype (Qwen3RMSNorm, then apply_rotary_pos_emb):
    norm:  n = x · rsqrt(mean(x²) + eps) in fp32;  y = w · n  (n rounded to the dtype, then y)
    rope:  out = x·cos + rotate_half(x)·sin,  rotate_half(x) = cat(-x₂, x₁)
           each product rounded to the dtype, then their sum rounded.
Done in fp32 with those roundings, with fp contraction off (no FMA), so fp32 is plain fp32
arithmetic and bf16 matches torch's eager bf16 ops.

Order: reference, kernel, launcher.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dominospec.kernels.rms_norm import round_rtne

# ---- reference --------------------------------------------------------------------------------


def _head_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm over the last dim: x [..., D], weight [D] -> [..., D] in x's dtype."""
    f = x.float()
    return weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cache_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot: torch.Tensor, num_heads: int, num_kv_heads: int,
                         q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
                         eps: float = 1e-6) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)·D], cos/sin [T, D], caches [Hkv, C, D], slot 0-d long -> q [T, Hq, D].

    Writes k (normed, rotated) and v into cache rows slot .. slot+T-1. Reads `slot` on the host.
    """
    T = qkv.shape[0]
    Hq, Hkv = num_heads, num_kv_heads
    D = qkv.shape[1] // (Hq + 2 * Hkv)
    heads = qkv.view(T, Hq + 2 * Hkv, D)
    q, k, v = heads[:, :Hq], heads[:, Hq:Hq + Hkv], heads[:, Hq + Hkv:]
    if q_norm is not None:
        q = _head_norm_reference(q, q_norm, eps)
    if k_norm is not None:
        k = _head_norm_reference(k, k_norm, eps)
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    start = int(slot)
    k_cache[:, start:start + T] = k.transpose(0, 1)
    v_cache[:, start:start + T] = v.transpose(0, 1)
    return q.contiguous()


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 -> the storage dtype -> fp32 (a no-op in fp32)."""
    return round_rtne(x, dtype).to(tl.float32)


@triton.jit
def _norm_rope(x1, x2, w_ptr, cos_row, sin_row, offs, mask, half, eps, dtype: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head's halves x₁, x₂ [HALF] (storage dtype) -> rotated halves (fp32 holding dtype values)."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * half) + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        f1 = _round(w1 * _round(f1 * inv, dtype), dtype)
        f2 = _round(w2 * _round(f2 * inv, dtype), dtype)
    c1 = tl.load(cos_row + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + offs, mask=mask, other=0.0).to(tl.float32)
    y1 = _round(_round(f1 * c1, dtype) - _round(f2 * s1, dtype), dtype)  # x₁·cos₁ + (-x₂)·sin₁
    y2 = _round(_round(f2 * c2, dtype) + _round(f1 * s2, dtype), dtype)  # x₂·cos₂ + x₁·sin₂
    return y1, y2


@triton.jit
def _rope_cache_fwd_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    Hq, Hkv, half, eps, stride_qkv, stride_cos, stride_sin, stride_q,
    stride_kc_h, stride_kc_c, stride_vc_h, stride_vc_c,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr,
):
    """Grid (T, Hq + 2·Hkv): program (t, h) handles head h of row t (q, then k, then v heads)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    mask = offs < half
    dtype = q_ptr.dtype.element_ty
    src = qkv_ptr + t * stride_qkv + h * (2 * half)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0)
    row = tl.load(slot_ptr).to(tl.int64) + t  # cache row of this token
    if h < Hq:
        y1, y2 = _norm_rope(x1, x2, q_norm_ptr, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, offs, mask,
                            half, eps, dtype, HAS_NORM)
        dst = q_ptr + t * stride_q + h * (2 * half)
        tl.store(dst + offs, y1.to(dtype), mask=mask)
        tl.store(dst + half + offs, y2.to(dtype), mask=mask)
    elif h < Hq + Hkv:
        y1, y2 = _norm_rope(x1, x2, k_norm_ptr, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, offs, mask,
                            half, eps, dtype, HAS_NORM)
        dst = k_cache_ptr + (h - Hq) * stride_kc_h + row * stride_kc_c
        tl.store(dst + offs, y1.to(dtype), mask=mask)
        tl.store(dst + half + offs, y2.to(dtype), mask=mask)
    else:
        dst = v_cache_ptr + (h - Hq - Hkv) * stride_vc_h + row * stride_vc_c
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + half + offs, x2, mask=mask)


# ---- launcher ---------------------------------------------------------------------------------


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot: torch.Tensor, num_heads: int, num_kv_heads: int,
               q_norm: Optional[torch.Tensor] = None, k_norm: Optional[torch.Tensor] = None,
               eps: float = 1e-6) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)·D], cos/sin [T, D] (qkv's dtype), caches [Hkv, C, D], slot 0-d long on device
    -> q [T, Hq, D] (contiguous); k, v written into cache rows slot + t. One launch, no host sync.

    q_norm / k_norm: [D] weights of a per-head RMSNorm before the rotation (both or neither).
    The caller keeps slot + T <= C (nothing checks it on the device).
    """
    T, width = qkv.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = width // (Hq + 2 * Hkv)
    assert width == (Hq + 2 * Hkv) * D and D % 2 == 0 and qkv.stride(-1) == 1
    assert cos.shape == (T, D) and sin.shape == (T, D) and cos.stride(-1) == 1 and sin.stride(-1) == 1
    assert cos.dtype == sin.dtype == qkv.dtype == k_cache.dtype == v_cache.dtype
    assert k_cache.shape[0] == Hkv and k_cache.shape[2] == D and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and slot.numel() == 1
    has_norm = q_norm is not None
    assert (k_norm is not None) == has_norm, "rope_cache: q_norm and k_norm come together"
    if has_norm:
        assert q_norm.shape == (D,) and k_norm.shape == (D,) and q_norm.dtype == k_norm.dtype == qkv.dtype
    q = torch.empty(T, Hq, D, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_fwd_kernel[(T, Hq + 2 * Hkv)](
        qkv, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos, slot, q, k_cache, v_cache,
        Hq, Hkv, D // 2, eps, qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HAS_NORM=has_norm, HALF=triton.next_power_of_2(D // 2), enable_fp_fusion=False,
    )
    return q
