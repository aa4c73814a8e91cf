"""Losses on the target's whole distribution, row by row and memory-light.

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

Gradients (m = 1[q < p]):

    d tv / d z = -(1/T) q * (m - sum_u q_u m_u)        d kd / d z = q1 - p1

Three implementations of the same loss (`train.distill_kernel`):
- `distill_rows` (rows): per-row values; chunks of fp32 rows, the target's softmaxes recomputed on
  every chunk, forward and backward. The reference the others are tested against.
- `fused_distill` (torch): the slot-weighted sum sum_n c_n row_n in one pass over row chunks that
  computes the value and its gradient together (saved in the logits' dtype; backward is a scale)
  and skips the rows with c_n = 0.
- the same on CUDA as one Triton kernel (`dominospec.kernels.distill`): z read three times, t twice,
  the gradient written once, all in the logits' dtype, the target's log-partitions read per target
  row (`teacher_logsumexp`: once per sequence position, not per block slot); docs/training.md has
  the costs.
None holds a [rows, V] fp32 copy nor the target's logits gathered per block slot.
"""

from __future__ import annotations

from typing import Optional

import torch

from dominospec.errors import UserError
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
    _check(mix, temperature)
    return _DistillRows.apply(logits, teacher.detach(), index, columns, float(temperature), float(mix))


def teacher_logsumexp(teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The target's logits [R, V] -> [R, 2] fp32: (lse(t / T), lse(t)) of every target row, in fp32 row
    chunks, for the kernel: p = exp(t / T - lse) then costs one exp per element where a slot reads its row."""
    out = torch.empty(teacher.shape[0], 2, dtype=torch.float32, device=teacher.device)
    step = chunk_rows(teacher)
    for a in range(0, teacher.shape[0], step):
        t = teacher[a:a + step].float()
        out[a:a + step, 1] = torch.logsumexp(t, -1)
        out[a:a + step, 0] = torch.logsumexp(t / temperature, -1)
    return out


def _fused_chunk(z: torch.Tensor, t: torch.Tensor, coef: torch.Tensor, T: float, mix: float, grad: bool):
    """fp32 draft logits z [c, V], target logits t [c, V] (both consumed: computed in place), row weights
    coef [c, 1] -> (rows [c], coef * d rows / d z [c, V] or None). A CPU pays by the [c, V] pass: one
    softmax is one, so the target's softmax is taken here rather than exp(t - lse) (two)."""
    value = torch.zeros(z.shape[0], dtype=torch.float32, device=z.device)
    d = None
    if mix < 1:  # kd = -p1 . log q1, gradient q1 - p1
        log_q1 = torch.log_softmax(z, -1)
        p1 = torch.softmax(t, -1)
        value -= (1.0 - mix) * torch.bmm(p1[:, None], log_q1[:, :, None]).view(-1)
        if grad:
            d = log_q1.exp_().sub_(p1).mul_(coef * (1.0 - mix))
        del p1, log_q1
    if mix > 0:  # tv = 1 - sum min(p, q), gradient -(1/T) (q m - q * sum q m), m = 1[q < p]
        qT = torch.softmax(z.mul_(1.0 / T), -1)
        pT = torch.softmax(t.mul_(1.0 / T), -1)
        value += mix * (1.0 - torch.minimum(pT, qT).sum(-1))
        if grad:
            qm = torch.where(qT < pT, qT, 0.0)
            tv = torch.addcmul(qm, qT, qm.sum(-1, keepdim=True), value=-1.0)
            d = tv.mul_(coef * (-mix / T)) if d is None else d.addcmul_(tv, coef, value=-mix / T)
    return value, d


class _FusedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher, index, coef, temperature: float, mix: float, kernel: str):
        grad = ctx.needs_input_grad[0]
        if kernel == "triton":
            from dominospec.kernels.distill import distill_forward

            lse = teacher_logsumexp(teacher, temperature)
            rows, saved = distill_forward(logits, teacher, index, lse, coef, temperature, mix, grad)
        else:
            rows = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
            saved = torch.zeros_like(logits) if grad else None
            live = coef.nonzero().flatten()  # the rows that count: c_n != 0
            step = chunk_rows(logits)
            for a in range(0, live.numel(), step):
                ids = live[a:a + step]
                value, d = _fused_chunk(logits.index_select(0, ids).float(),
                                        teacher.index_select(0, index[ids]).float(), coef[ids, None],
                                        temperature, mix, grad)
                rows[ids] = value
                if grad:
                    saved.index_copy_(0, ids, d.to(saved.dtype))
        ctx.saved = saved
        ctx.mark_non_differentiable(rows)
        return (rows * coef).sum(), rows

    @staticmethod
    def backward(ctx, grad_total, grad_rows):
        grad, ctx.saved = ctx.saved, None  # once: the gradient is scaled in place
        return grad.mul_(grad_total), None, None, None, None, None, None


def fused_distill(logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, coef: torch.Tensor,
                  temperature: float = 1.0, mix: float = 0.0, columns: Optional[torch.Tensor] = None,
                  kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [N, V'], the target's logits [R, V], index [N], row weights c [N] (0: skipped), T, mix,
    columns [V'] (None: V' = V), kernel torch | triton -> (sum_n c_n row_n, a scalar differentiable in
    `logits`; rows [N] fp32, 0 where c_n = 0), row_n = `distill_rows`' value. The gradient is computed
    in the forward and kept in the logits' dtype (rounded once there and once more by a backward scale
    other than 1)."""
    _check(mix, temperature)
    teacher = teacher.detach()
    if columns is not None:  # the loss vocabulary's columns, once per target row
        teacher = teacher.index_select(1, columns)
    return _FusedDistill.apply(logits, teacher, index, coef.float(), float(temperature), float(mix), kernel)


def _check(mix: float, temperature: float) -> None:
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"the tv mix must lie in [0, 1], got {mix}")
    if temperature <= 0:
        raise ValueError(f"the tv temperature must be > 0, got {temperature}")


def block_teacher_index(positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Block slot positions [B, N, Bk] (slot j of anchor a sits at a + j), sequence length T ->
    index [B*N*Bk] into the target's logits flattened to [B*T, V]: row b*T + a + j, the target's
    distribution over the slot's label x[a+1+j] (clamped in bounds; those slots are masked)."""
    B = positions.shape[0]
    base = torch.arange(B, device=positions.device).view(B, 1, 1) * seq_len
    return (base + positions.clamp(max=seq_len - 1)).reshape(-1)


def weighted_distill(logits: torch.Tensor, target_logits: torch.Tensor, index: torch.Tensor, label_mask: torch.Tensor,
                     weights: torch.Tensor, temperature: float, mix: float,
                     columns: Optional[torch.Tensor] = None, kernel: str = "rows") -> torch.Tensor:
    """logits [..., Bk, V'], target_logits [B, T, V], index [prod(...) * Bk] (`block_teacher_index`),
    label_mask [..., Bk], w [Bk], kernel rows | torch | triton (`distill_kernel`) -> scalar
    sum(w * row) / sum(w) over supervised slots."""
    V = logits.shape[-1]
    w = weights.to(logits.device) * label_mask.float()  # [..., Bk]
    flat_logits, flat_target = logits.reshape(-1, V), target_logits.reshape(-1, target_logits.shape[-1])
    if kernel == "rows":
        rows = distill_rows(flat_logits, flat_target, index, temperature, mix, columns).view(label_mask.shape)
        return (w * rows).sum() / w.sum().clamp(min=1e-12)
    coef = (w / w.sum().clamp(min=1e-12)).reshape(-1)
    return fused_distill(flat_logits, flat_target, index, coef, temperature, mix, columns, kernel)[0]


def distill_kernel(kernel: str, device: torch.device) -> str:
    """train.distill_kernel (auto | rows | torch | triton) on `device` -> the implementation
    `weighted_distill` runs: auto = triton on CUDA when triton imports, torch elsewhere. Raises
    UserError for `triton` where it cannot run."""
    if kernel in ("rows", "torch") or (kernel == "auto" and device.type != "cuda"):
        return "torch" if kernel == "auto" else kernel
    try:
        from dominospec.kernels import cross_entropy
    except ImportError as e:
        missing = f"triton needs the triton package ({e})"
    else:
        missing = None if cross_entropy.available(device) else \
            f"triton cannot run on {device} (needs CUDA, or TRITON_INTERPRET=1)"
    if missing is None:
        return "triton"
    if kernel == "auto":
        return "torch"
    raise UserError(f"train.distill_kernel: {missing}; set train.distill_kernel: torch or auto")


__all__ = ["acceptance_probability", "distill_rows", "teacher_logsumexp", "fused_distill", "block_teacher_index",
           "weighted_distill", "distill_kernel"]
