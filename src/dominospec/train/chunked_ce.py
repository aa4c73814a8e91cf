"""Per-row cross-entropy over a wide vocabulary without fp32 copies of the logits.

`F.cross_entropy(logits.float(), labels)` on bf16 logits [N, V] (N = blocks x slots, V = 49,152
for SmolLM2) materialises an fp32 copy, an fp32 log-softmax and, in backward, two more fp32
[N, V] tensors: on a CPU that memory traffic costs more than the LM-head GEMM itself
(benchmarks/train_step.py). `chunked_cross_entropy` computes the same per-row losses
(fp32 arithmetic on each chunk, rows in chunks of `CHUNK_ROWS`), keeps only the logits it was
given and the per-row logsumexp [N] for backward, and writes the gradient directly in the
logits' dtype:

    loss_i = lse_i - x_i[y_i],    d loss_i / d x_i = softmax(x_i) - onehot(y_i)

Same math as the reference; the gradient is rounded once to the logits' dtype, as autograd
does when it casts the fp32 gradient back through `.float()`.
"""

from __future__ import annotations

import torch

from dominospec.errors import UserError

CHUNK_ROWS = 64  # rows per fp32 chunk on a CPU: 64 x 49,152 x 4 B = 12.6 MB, within a core's L2/L3 reach
DEVICE_CHUNK_BYTES = 1 << 29  # on an accelerator: fp32 chunks of up to 512 MiB (4 tensors live at once)


def chunk_rows(logits: torch.Tensor) -> int:
    """Rows per fp32 chunk for these logits [N, V]. A CPU wants chunks that stay in cache; a GPU
    wants few, large ones: each chunk is ~10 kernel launches, and 64-row chunks of 16k rows
    cost more host time than the GEMMs (benchmarks/train_step_gpu.py)."""
    if logits.device.type == "cpu":
        return CHUNK_ROWS
    return max(CHUNK_ROWS, DEVICE_CHUNK_BYTES // (4 * logits.shape[1]))


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        N, rows = logits.shape[0], chunk_rows(logits)
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        for a in range(0, N, rows):
            lse[a:a + rows] = torch.logsumexp(logits[a:a + rows].float(), dim=-1)
        picked = logits.gather(1, labels[:, None])[:, 0].float()
        ctx.save_for_backward(logits, labels, lse)
        return lse - picked  # [N] fp32

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g, step = grad_loss.float(), chunk_rows(logits)
        for a in range(0, logits.shape[0], step):
            rows = slice(a, a + step)
            p = torch.exp(logits[rows].float() - lse[rows, None])  # softmax [chunk, V]
            p.scatter_add_(1, labels[rows, None], torch.full_like(p[:, :1], -1.0))
            grad[rows] = (p * g[rows, None]).to(grad.dtype)
        return grad, None


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype), labels [N] long in 0..V-1 -> per-row CE [N] fp32."""
    return _ChunkedCE.apply(logits, labels)


def row_cross_entropy(kernel: str, device: torch.device):
    """train.ce_kernel (auto | torch | triton) on `device` -> the per-row CE the loss uses:
    `chunked_cross_entropy`, or the fused Triton kernel (dominospec.kernels.cross_entropy: one
    read of the logits forward, one read and one write backward). auto = the kernel on CUDA when
    triton imports. Raises UserError for `triton` where it cannot run."""
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return chunked_cross_entropy
    try:
        from dominospec.kernels import cross_entropy as fused
    except ImportError as e:
        fused, missing = None, f"triton needs the triton package ({e})"
    else:
        missing = None if fused.available(device) else f"triton cannot run on {device} (needs CUDA, or TRITON_INTERPRET=1)"
    if missing is None:
        return fused.cross_entropy
    if kernel == "auto":
        return chunked_cross_entropy
    raise UserError(f"train.ce_kernel: {missing}; set train.ce_kernel: torch or auto")
