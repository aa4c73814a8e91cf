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

CHUNK_ROWS = 64  # rows per fp32 chunk: 64 x 49,152 x 4 B = 12.6 MB, within a CPU core's L2/L3 reach


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        N = logits.shape[0]
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        for a in range(0, N, CHUNK_ROWS):
            lse[a:a + CHUNK_ROWS] = torch.logsumexp(logits[a:a + CHUNK_ROWS].float(), dim=-1)
        picked = logits.gather(1, labels[:, None])[:, 0].float()
        ctx.save_for_backward(logits, labels, lse)
        return lse - picked  # [N] fp32

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g = grad_loss.float()
        for a in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(a, a + CHUNK_ROWS)
            p = torch.exp(logits[rows].float() - lse[rows, None])  # softmax [chunk, V]
            p.scatter_add_(1, labels[rows, None], torch.full_like(p[:, :1], -1.0))
            grad[rows] = (p * g[rows, None]).to(grad.dtype)
        return grad, None


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype), labels [N] long in 0..V-1 -> per-row CE [N] fp32."""
    return _ChunkedCE.apply(logits, labels)
