"""Fused per-row cross-entropy over a wide vocabulary: the draft's training loss on a GPU.

    loss_i = lse_i - x_i[y_i],    d loss_i / d x_i = softmax(x_i) - onehot(y_i)

logits x [N, V] (any float dtype; bf16, V = 49,152, N ≈ 32k rows in training), labels y [N] long
-> loss [N] fp32. Same contract as `dominospec.train.chunked_ce.chunked_cross_entropy`, whose
torch chunks (~10 launches and fp32 [chunk, V] temporaries each) this replaces by two kernels:
1. forward, grid (N,): each program streams its row in BLOCK_V chunks with an online logsumexp
   (the row's running max, a scalar from each chunk's max; Σ exp(x - max), BLOCK_V lanes summed
   at the end) and writes lse[n] (kept for backward) and loss[n]. A per-lane max would cost a
   second exp per element, which makes the forward exp-bound on an H200 (journal);
2. backward, grid (N,): reads the row again and writes grad[n, v] = (exp(x - lse) - [v == y]) · g[n]
   straight in the logits' dtype (rounded once, as autograd casts the fp32 gradient back).
   Rows with g[n] == 0 (unsupervised slots) skip the row's reads and exps and write zeros.
Only x, y, lse [N] and the gradient touch memory: no fp32 copy of the logits.

Order: reference, kernels, launchers. Arithmetic is fp32 whatever the storage dtype. Labels in
0..V-1 are the caller's job, as in torch. Importing this module needs triton (as every kernel here).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# ---- reference --------------------------------------------------------------------------------


def cross_entropy_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [N, V], labels [N] long -> per-row CE [N] fp32 (fp32 arithmetic)."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _ce_forward_kernel(x_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride_x, BLOCK_V: tl.constexpr):
    """Grid (N,): row n -> lse[n] = logsumexp(x[n]), loss[n] = lse[n] - x[n, y[n]] (fp32)."""
    row = tl.program_id(0).to(tl.int64)  # row * stride: past int32 beyond 43,690 rows of 49,152
    x_row = x_ptr + row * stride_x
    lanes = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)  # running row max (a scalar)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)  # per-lane Σ exp(x - m); a lane -inf throughout stays 0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + lanes
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0, not NaN
        s = s * tl.exp(m - shift) + tl.exp(x - shift)  # one exp per element, one per chunk
        m = m_new
    shift = tl.where(m == float("-inf"), 0.0, m)
    lse = shift + tl.log(tl.sum(s, axis=0))  # an all -inf row: log 0 = -inf, as torch
    picked = tl.load(x_row + tl.load(labels_ptr + row)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, lse - picked)


@triton.jit
def _ce_backward_kernel(x_ptr, labels_ptr, lse_ptr, g_ptr, grad_ptr, V, stride_x, stride_grad,
                        BLOCK_V: tl.constexpr):
    """Grid (N,): row n -> grad[n, :] = (exp(x[n] - lse[n]) - onehot(y[n])) · g[n], in grad's dtype."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    grad_row = grad_ptr + row * stride_grad
    lanes = tl.arange(0, BLOCK_V)
    g = tl.load(g_ptr + row)
    if g == 0.0:  # unsupervised row: zeros, the logits are not read
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            tl.store(grad_row + offs, tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty), mask=offs < V)
    else:
        lse = tl.load(lse_ptr + row)
        label = tl.load(labels_ptr + row)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            mask = offs < V
            x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)  # [BLOCK_V] fp32
            tl.store(grad_row + offs, (p * g).to(grad_ptr.dtype.element_ty), mask=mask)


# ---- launchers --------------------------------------------------------------------------------

# Chunk width and warps on a GPU: 4096 columns (12 chunks of a 49,152 row), 4 warps, the fastest
# of an H200 sweep at 32k x 49,152 bf16, where neighbouring widths and 4-8 warps came close and 16
# warps were slower (docs/kernels.md, the journal). The interpreter (CPU tests) takes 1024, so small
# test shapes still span several chunks, a ragged last one, and rows narrower than one chunk.
BLOCK_V, NUM_WARPS = 4096, 4
INTERPRET_BLOCK_V = 1024


def available(device: torch.device | str) -> bool:
    """Can the kernels run on tensors on `device`? On CUDA; on any device under TRITON_INTERPRET=1
    (which must be set before triton is imported, as tests/kernels/conftest.py does)."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def launch_config(logits: torch.Tensor, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS) -> dict:
    """-> a row kernel's BLOCK_V / num_warps for these logits (the GPU's, default these kernels' constants,
    or the interpreter's)."""
    if logits.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"BLOCK_V": block_v, "num_warps": num_warps}
    return {"BLOCK_V": INTERPRET_BLOCK_V}


class _TritonCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        N, V = logits.shape
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        if N:
            _ce_forward_kernel[(N,)](logits, labels, loss, lse, V, logits.stride(0), **launch_config(logits))
        ctx.save_for_backward(logits, labels, lse)
        return loss  # [N] fp32

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        N, V = logits.shape
        grad = torch.empty(N, V, dtype=logits.dtype, device=logits.device)
        g = grad_loss.float().contiguous()  # [N]; a sum's backward hands an expanded, stride-0 one
        if N:
            _ce_backward_kernel[(N,)](logits, labels, lse, g, grad, V, logits.stride(0), grad.stride(0),
                                      **launch_config(logits))
        return grad, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype; rows may be strided, columns contiguous), labels [N] long
    in 0..V-1 -> per-row CE [N] fp32, differentiable in logits (= `cross_entropy_reference`)."""
    assert logits.dim() == 2 and logits.is_floating_point(), (tuple(logits.shape), logits.dtype)
    assert labels.shape == logits.shape[:1] and labels.dtype == torch.long, (tuple(labels.shape), labels.dtype)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _TritonCE.apply(logits, labels.contiguous())
