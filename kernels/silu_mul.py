"""SiLU(gate) · up of a gated MLP from one fused gate/up matmul, one launch.

gate_up [N, 2I] is `x · [W_gate; W_up]ᵀ` (gate columns first). HF's LlamaMLP / Qwen3MLP compute
`act_fn(gate) * up` as two eager ops, so the rounding here is theirs:
    a   = silu(gate)   in fp32 (x / (1 + exp(-x))), rounded to the storage dtype
    out = a · up       in fp32, rounded to the storage dtype

Order: reference, kernel, launcher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dominospec.kernels.rms_norm import round_rtne

# ---- reference --------------------------------------------------------------------------------


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] -> out [N, I] in gate_up's dtype: silu(gate) * up with eager rounding."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def _silu_mul_fwd_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr):
    """Grid (cdiv(I, BLOCK), N): program (i, row) writes out[row, i*BLOCK : (i+1)*BLOCK]."""
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    a = round_rtne(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, round_rtne(a * u, dtype), mask=mask)


# ---- launcher ---------------------------------------------------------------------------------


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [N, 2I] (columns contiguous, rows may be strided) -> out [N, I] in its dtype, one launch."""
    N, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(-1) == 1
    I = two_i // 2
    out = torch.empty(N, I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(I))
    _silu_mul_fwd_kernel[(triton.cdiv(I, block), N)](gate_up, out, I, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
