"""Fused distillation loss on the target's whole distribution: the acceptance loss and kd in one kernel.

For draft row n (logits z [V]) and its target row r = index[n] (logits t [V]), at temperature T:

    qT = softmax(z / T), pT = softmax(t / T), q1 = softmax(z), p1 = softmax(t)
    row_n = mix * (1 - sum_v min(pT_v, qT_v)) + (1 - mix) * (lse(z) - sum_v p1_v z_v)
    d row_n / d z = -(mix / T) * qT * (m - sum_u qT_u m_u) + (1 - mix) * (q1 - p1),   m = 1[qT < pT]

(the math of `dominospec.train.distill`). The loss is the weighted sum sum_n c_n row_n (c [N]: the
slot weights over the supervised slots, 0 elsewhere), so its gradient c_n d row_n / d z is known in
the forward: the kernel writes it there, in the logits' dtype, and the backward only scales it by
the scalar upstream gradient (as Liger's fused linear cross-entropy does). The target's
log-partitions lse(t / T) and lse(t) come in per target row ([R, 2], `teacher_logsumexp`), computed
once per sequence position, not once per block slot.

Grid (N,); each program streams its row in BLOCK_V chunks (fp32 arithmetic whatever the storage):
1. z only: the row max (a scalar) and, per lane, sum exp(z - max) and sum exp((z - max) / T)
   -> lse(z), lse(z / T);
2. (mix > 0) z and t: sum min(pT, qT) and s = sum qT m -> the acceptance term;
3. z and t: the gradient, written once, and (mix < 1) sum p1 z -> the kd term.
Rows with c_n == 0 (unsupervised slots, padded anchors) read nothing and write zeros.
Memory traffic: z three times (twice for kd alone), t twice (once), the gradient once: no fp32
[N, V] copy, no per-slot copy of the target's logits.

Order: reference, kernel, launchers. Importing this module needs triton (as every kernel here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dominospec.kernels.cross_entropy import launch_config

# ---- reference --------------------------------------------------------------------------------


def distill_reference(logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, temperature: float,
                      mix: float) -> torch.Tensor:
    """logits [N, V], teacher [R, V], index [N] -> per-row mix * tv + (1 - mix) * kd [N] fp32, the plain
    formula through autograd (fp32 arithmetic; memory O(N V): tiny shapes only)."""
    z, t = logits.float(), teacher.float()[index]
    p, q = torch.softmax(t / temperature, -1), torch.softmax(z / temperature, -1)
    tv = 1.0 - torch.minimum(p, q).sum(-1)
    kd = -(torch.softmax(t, -1) * torch.log_softmax(z, -1)).sum(-1)
    return mix * tv + (1.0 - mix) * kd


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def _distill_kernel(z_ptr, t_ptr, index_ptr, t_lse_ptr, coef_ptr, loss_ptr, grad_ptr, V, stride_z, stride_t,
                    stride_grad, inv_T, mix, TV: tl.constexpr, KD: tl.constexpr, GRAD: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    """Grid (N,): row n -> loss[n] = mix * tv + (1 - mix) * kd (0 where c[n] == 0) and, with GRAD,
    grad[n, :] = c[n] * d loss[n] / d z[n] in grad's dtype. t_lse [R, 2]: lse(t / T), lse(t)."""
    row = tl.program_id(0).to(tl.int64)  # row * stride: past int32 beyond 43,690 rows of 49,152
    lanes = tl.arange(0, BLOCK_V)
    grad_row = grad_ptr + row * stride_grad
    c = tl.load(coef_ptr + row)
    if c == 0.0:  # unsupervised slot: no reads, loss 0, zero gradient
        tl.store(loss_ptr + row, 0.0)
        if GRAD:
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                tl.store(grad_row + offs, tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty), mask=offs < V)
    else:
        z_row = z_ptr + row * stride_z
        r = tl.load(index_ptr + row).to(tl.int64)
        t_row = t_ptr + r * stride_t
        t_lse_T = tl.load(t_lse_ptr + 2 * r)
        t_lse_1 = tl.load(t_lse_ptr + 2 * r + 1)
        # 1. lse(z) and lse(z / T): one running max, per-lane sums rescaled when it grows.
        m = tl.full([], float("-inf"), tl.float32)
        s1 = tl.zeros([BLOCK_V], dtype=tl.float32)
        sT = tl.zeros([BLOCK_V], dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            z = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            s1 = s1 * tl.exp(m - shift) + tl.exp(z - shift)
            if TV:
                sT = sT * tl.exp((m - shift) * inv_T) + tl.exp((z - shift) * inv_T)
            m = m_new
        shift = tl.where(m == float("-inf"), 0.0, m)
        lse_1 = shift + tl.log(tl.sum(s1, axis=0))
        lse_T = shift * inv_T + tl.log(tl.maximum(tl.sum(sT, axis=0), 1.0))  # >= 1 with TV (the max's exp(0)); no log 0 without
        # 2. the acceptance term: sum min(pT, qT), and s = sum qT * 1[qT < pT] for its gradient.
        overlap = tl.zeros([BLOCK_V], dtype=tl.float32)
        below = tl.zeros([BLOCK_V], dtype=tl.float32)
        if TV:
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                z = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                t = tl.load(t_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                qT = tl.exp(z * inv_T - lse_T)
                pT = tl.exp(t * inv_T - t_lse_T)
                overlap += tl.minimum(qT, pT)
                below += tl.where(qT < pT, qT, 0.0)
        s = tl.sum(below, axis=0)
        # 3. the gradient, and sum p1 z for kd.
        p1z = tl.zeros([BLOCK_V], dtype=tl.float32)
        if KD or GRAD:
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                inside = offs < V
                z = tl.load(z_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
                t = tl.load(t_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
                d = tl.zeros([BLOCK_V], dtype=tl.float32)
                if TV:
                    qT = tl.exp(z * inv_T - lse_T)
                    pT = tl.exp(t * inv_T - t_lse_T)
                    d -= (mix * inv_T) * (tl.where(qT < pT, qT, 0.0) - qT * s)
                if KD:
                    p1 = tl.exp(t - t_lse_1)
                    p1z += p1 * tl.where(inside, z, 0.0)  # masked lanes: p1 = 0, z = -inf
                    d += (1.0 - mix) * (tl.exp(z - lse_1) - p1)
                if GRAD:
                    tl.store(grad_row + offs, (d * c).to(grad_ptr.dtype.element_ty), mask=inside)
        loss = tl.zeros([], dtype=tl.float32)
        if TV:
            loss += mix * (1.0 - tl.sum(overlap, axis=0))
        if KD:
            loss += (1.0 - mix) * (lse_1 - tl.sum(p1z, axis=0))
        tl.store(loss_ptr + row, loss)


# ---- launchers --------------------------------------------------------------------------------

# Chunk width and warps on a GPU: 2048 columns over 4 warps, 16 elements a thread for each of the up
# to six [BLOCK_V] values live in pass 2 (z, t, qT, pT and two sums), where the cross-entropy's 4096
# would hold 32 each and risk spilling registers. Not yet swept on a GPU: `benchmarks/train_step_gpu.py`
# takes the knobs distill_block=N and distill_warps=N.
BLOCK_V, NUM_WARPS = 2048, 4


def distill_forward(logits: torch.Tensor, teacher: torch.Tensor, index: torch.Tensor, teacher_lse: torch.Tensor,
                    coef: torch.Tensor, temperature: float, mix: float,
                    grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] (rows may be strided), teacher [R, V], index [N] long, teacher_lse [R, 2] fp32,
    coef [N] fp32 -> (rows [N] fp32, 0 where coef is 0; the weighted sum's gradient c_n d row_n / d z
    [N, V] in the logits' dtype, or None without `grad`). One launch (module docstring)."""
    N, V = logits.shape
    assert teacher.shape[1] == V and index.shape == (N,) and coef.shape == (N,), \
        (tuple(logits.shape), tuple(teacher.shape), tuple(index.shape), tuple(coef.shape))
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    teacher = teacher if teacher.stride(1) == 1 else teacher.contiguous()
    rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    out = torch.empty(N, V, dtype=logits.dtype, device=logits.device) if grad else rows  # rows: an unused pointer
    if N:
        _distill_kernel[(N,)](logits, teacher, index.contiguous(), teacher_lse.float().contiguous(),
                              coef.float().contiguous(), rows, out, V, logits.stride(0), teacher.stride(0),
                              out.stride(0) if grad else 0, 1.0 / temperature, mix, TV=mix > 0, KD=mix < 1,
                              GRAD=grad, **launch_config(logits, BLOCK_V, NUM_WARPS))
    return rows, out if grad else None
