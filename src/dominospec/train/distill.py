"""Losses on the target's whole next-token distribution, row by row and memory-light.

For one block slot the target's logits t [V] and the draft's logits z [V] give, at a temperature T,
p = softmax(t / T) and q = softmax(z / T). Speculative sampling at T accepts the draft's draw
d ~ q with probability min(1, p(d) / q(d)), so the slot's acceptance probability is

    a(p, q) = sum_v min(p_v, q_v) = 1 - TV(p, q)

(engine.accept; the sampled walk in train/walk.py chains it along a block). Two per-row losses:

    tv   = 1 - sum_v min(p_v, q_v)                    the acceptance a sampled round loses; maximising
                                                      sum min(p, q) is exactly maximising acceptance
    kd   = -sum_v p1_v log q1_v,  p1 = softmax(t), q1 = softmax(z)   (T = 1: cross-entropy against the
                                                      target's distribution, KL up to a constant)

and their mix `mix * tv + (1 - mix) * kd` (train.loss: tv, train.tv_mix). TV alone has a flat
gradient where q already covers p (only tokens with q < p pull), the KD term keeps every token's
gradient alive; mix 0 is plain KD.

Gradients (m = 1[q < p], written once per row in the logits' dtype):

    d tv / d z = -(1/T) q * (m - sum_u q_u m_u)        d kd / d z = q1 - p1

`distill_rows` computes the losses and, in backward, the gradients on row chunks of fp32
(`chunk_rows`): only the logits it was given, the target's logits and a row index are held, never
a [rows, V] fp32 copy nor the target's logits gathered per block slot.
"""

from __future__ import annotations

from typing import Optional

import torch

from dominospec.train.chunked_ce import chunk_rows


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q [..., V] probabilities -> a [...] = sum_v min(p_v, q_v), a sampled draft's acceptance."""
    return torch.minimum(p, q).sum(-1)


def _chunk(logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, columns: Optional[torch.Tensor],
           rows: slice, temperature: float):
    """-> fp32 (z, t) of one row chunk: draft logits [c, V'], target logits [c, V'] (its rows by `index`,
    its columns by `columns` when the loss spans a vocabulary V' < V)."""
    z = logits[rows].float()
    t = teacher.index_select(0, index[rows]).float()
    if columns is not None:
        t = t.index_select(1, columns)
    return z, t


class _DistillRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher, index, columns, temperature: float, mix: float):
        N = logits.shape[0]
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)
        step = chunk_rows(logits)
        for a in range(0, N, step):
            rows = slice(a, a + step)
            z, t = _chunk(logits, teacher, index, columns, rows, temperature)
            value = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
            if mix > 0:
                value += mix * (1.0 - acceptance_probability(torch.softmax(t / temperature, -1),
                                                              torch.softmax(z / temperature, -1)))
            if mix < 1:
                value += (1.0 - mix) * -(torch.softmax(t, -1) * torch.log_softmax(z, -1)).sum(-1)
            loss[rows] = value
        ctx.save_for_backward(logits, teacher, index, columns)
        ctx.temperature, ctx.mix = temperature, mix
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, teacher, index, columns = ctx.saved_tensors
        T, mix = ctx.temperature, ctx.mix
        grad = torch.empty_like(logits)
        g, step = grad_loss.float(), chunk_rows(logits)
        for a in range(0, logits.shape[0], step):
            rows = slice(a, a + step)
            z, t = _chunk(logits, teacher, index, columns, rows, T)
            d = torch.zeros_like(z)
            if mix > 0:
                q = torch.softmax(z / T, -1)
                qm = q * (q < torch.softmax(t / T, -1)).float()  # q * m
                d -= (mix / T) * (qm - q * qm.sum(-1, keepdim=True))
            if mix < 1:
                d += (1.0 - mix) * (torch.softmax(z, -1) - torch.softmax(t, -1))
            grad[rows] = (d * g[rows, None]).to(grad.dtype)
        return grad, None, None, None, None, None


def distill_rows(logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                 mix: float = 0.0, columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Draft logits [N, V'] (any float dtype), the target's logits [R, V], index [N] (the target row of
    each draft row), T, mix in [0, 1], columns [V'] (the loss vocabulary's ids; None: V' = V) ->
    per-row `mix * tv + (1 - mix) * kd` [N] fp32 (module docstring). Gradients reach `logits` only."""
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"the tv mix must lie in [0, 1], got {mix}")
    if temperature <= 0:
        raise ValueError(f"the tv temperature must be > 0, got {temperature}")
    return _DistillRows.apply(logits, teacher.detach(), index, columns, float(temperature), float(mix))


def block_teacher_index(positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Block slot positions [B, N, Bk] (slot j of anchor a sits at a + j), sequence length T ->
    index [B*N*Bk] into the target's logits flattened to [B*T, V]: row b*T + a + j, the target's
    distribution over the slot's label x[a+1+j] (clamped in bounds; those slots are masked)."""
    B = positions.shape[0]
    base = torch.arange(B, device=positions.device).view(B, 1, 1) * seq_len
    return (base + positions.clamp(max=seq_len - 1)).reshape(-1)


def weighted_distill(logits: torch.Tensor, target_logits: torch.Tensor, index: torch.Tensor, label_mask: torch.Tensor,
                     weights: torch.Tensor, temperature: float, mix: float,
                     columns: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [..., Bk, V'], target_logits [B, T, V], index [prod(...) * Bk] (`block_teacher_index`),
    label_mask [..., Bk], w [Bk] -> scalar sum(w * row) / sum(w) over supervised slots."""
    V = logits.shape[-1]
    rows = distill_rows(logits.reshape(-1, V), target_logits.reshape(-1, target_logits.shape[-1]), index,
                        temperature, mix, columns).view(label_mask.shape)
    w = weights.to(rows.device) * label_mask.float()
    return (w * rows).sum() / w.sum().clamp(min=1e-12)


__all__ = ["acceptance_probability", "distill_rows", "block_teacher_index", "weighted_distill"]
