"""RMSNorm with the residual add before it (HF LlamaRMSNorm / Qwen3RMSNorm), one launch.

A decoder layer does `s = residual + x; out = norm(s)` twice; this fuses the add, the reduction and
the scale, and hands `s` back as the next residual:
    s   = residual + x                    rounded to the storage dtype (s = x without a residual)
    n   = s · rsqrt(mean(s²) + eps)       in fp32, from the rounded s
    out = weight · n                      n rounded to the storage dtype first, then the product
The rounding order is HF's, so bf16 outputs agree with the eager module up to the fp32 summation
order of mean(s²).

Order: reference, kernel, launcher.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# ---- reference --------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], weight [H], residual [N, H] or None -> (out [N, H], summed [N, H]), both in x's dtype."""
    s = x if residual is None else residual + x  # rounded to x.dtype
    f = s.float()
    n = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * n.to(x.dtype), s


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def round_rtne(x, dtype: tl.constexpr):
    """fp32 x -> `dtype`, rounded to nearest even. On the GPU that is `x.to(dtype)`; Triton's CPU
    interpreter truncates fp32 -> bf16 instead, so bf16 is rounded here in the bits first (the
    cast is then exact). Shared by the decoder kernels (silu_mul, rope_cache, tree_attention)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                         stride_x, stride_res, stride_out, stride_sum,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (N,): program `row` normalises one row of H (contiguous) elements; BLOCK >= H."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    dtype = out_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        s = round_rtne(r.to(tl.float32) + s.to(tl.float32), dtype)  # the sum, rounded as torch rounds it
        tl.store(sum_ptr + row * stride_sum + offs, s, mask=mask)
    f = s.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(f * f, axis=0) / H + eps)
    n = round_rtne(f * inv, dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, round_rtne(w * n, dtype), mask=mask)


# ---- launcher ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], weight [H], residual [N, H] or None -> (out [N, H], summed [N, H]) in x's dtype.

    Rows may be strided (H contiguous). Without a residual `summed` is `x` itself (no copy); with
    one it is a new contiguous tensor. No host sync: capturable in a CUDA graph.
    """
    N, H = x.shape
    assert weight.shape == (H,) and weight.dtype == x.dtype and weight.stride(0) == 1
    assert x.stride(-1) == 1 or H == 1
    out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    has_res = residual is not None
    if has_res:
        assert residual.shape == x.shape and residual.dtype == x.dtype and (residual.stride(-1) == 1 or H == 1)
        summed = torch.empty_like(out)
    else:
        summed = x
    _rms_norm_fwd_kernel[(N,)](
        x, residual if has_res else x, weight, out, summed, H, eps,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0), summed.stride(0),
        HAS_RESIDUAL=has_res, BLOCK=triton.next_power_of_2(H),
    )
    return out, summed
