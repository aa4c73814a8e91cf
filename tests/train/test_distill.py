"""The losses on the target's whole distribution (train/distill.py) against plain torch references:
the acceptance loss is 1 - sum min(p, q), kd is the soft cross-entropy, their mix mixes, the
row-chunked autograd equals autograd through the plain formula, and gradients reach the draft."""

import pytest
import torch

from dominospec.train import distill as D
from dominospec.train import objective as O


def plain_rows(z, t, T, mix):
    """The reference: autograd through the formulas, fp64."""
    p, q = torch.softmax(t / T, -1), torch.softmax(z / T, -1)
    tv = 1 - torch.minimum(p, q).sum(-1)
    kd = -(torch.softmax(t, -1) * torch.log_softmax(z, -1)).sum(-1)
    return mix * tv + (1 - mix) * kd


def case(rows=150, V=37, R=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(rows, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    t = torch.randn(R, V, generator=g, dtype=torch.float64) * 2
    index = torch.randint(0, R, (rows,), generator=g)
    return z, t, index


def test_tv_value_is_one_minus_sum_of_min_p_q():
    z, t, index = case()
    p, q = torch.softmax(t[index] / 0.7, -1), torch.softmax(z / 0.7, -1)
    loss = D.distill_rows(z, t, index, temperature=0.7, mix=1.0)
    expected = torch.tensor([1 - sum(min(a, b) for a, b in zip(pr.tolist(), qr.tolist())) for pr, qr in zip(p, q)],
                            dtype=torch.float32)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    assert loss.min() > 0.05 and loss.max() < 1  # random p and q: partial overlap, a signal to check


@pytest.mark.parametrize("mix, T", [(1.0, 1.0), (1.0, 0.7), (0.0, 1.0), (0.5, 0.7)])
def test_chunked_rows_and_gradients_equal_the_plain_formula(mix, T):
    z, t, index = case(rows=150)  # > CHUNK_ROWS (64): three chunks
    loss = D.distill_rows(z, t, index, temperature=T, mix=mix)
    ref_z = z.detach().clone().requires_grad_(True)
    ref = plain_rows(ref_z, t[index], T, mix)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)  # fp32 chunks
    g = torch.randn(150, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (loss.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert z.grad.abs().max() > 1e-3  # the gradient flows
    torch.testing.assert_close(z.grad, ref_z.grad, rtol=0, atol=1e-6)


def test_columns_of_a_loss_vocabulary_read_the_targets_same_tokens():
    z, t, index = case(V=37)
    columns = torch.tensor([0, 3, 5, 8, 13, 21, 34])
    sub = z.detach()[:, columns]
    got = D.distill_rows(sub, t, index, 0.7, 0.5, columns)
    torch.testing.assert_close(got.double(), plain_rows(sub, t[index][:, columns], 0.7, 0.5), rtol=0, atol=1e-6)


def test_kd_mix_zero_equals_the_soft_cross_entropy_it_replaces():
    """train.loss: kd now runs through distill_rows (mix 0): the same loss as objective.soft_ce on
    the teacher gathered per block slot."""
    g = torch.Generator().manual_seed(3)
    B, T, V, N, Bk = 2, 12, 19, 3, 4
    target_logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(3, V, (B, T), generator=g)
    blocks = O.make_blocks(ids, torch.ones(B, T, dtype=torch.bool), N, Bk, 1, generator=g)
    logits = torch.randn(B, N, Bk, V, generator=g)
    w = O.position_weights(Bk, 2.0)
    plain = O.soft_ce(logits, O.teacher_block_logits(target_logits, blocks), blocks.label_mask, w)
    index = D.block_teacher_index(blocks.positions, T)
    ours = D.weighted_distill(logits, target_logits, index, blocks.label_mask, w, temperature=1.0, mix=0.0)
    torch.testing.assert_close(ours, plain, rtol=0, atol=1e-5)


def test_a_draft_equal_to_the_target_loses_nothing_and_a_step_raises_acceptance():
    z, t, index = case(rows=64)
    assert D.distill_rows(t[index], t, index, 1.0, 1.0).abs().max() < 1e-6  # q = p: accepted always
    before = D.distill_rows(z, t, index, 1.0, 1.0).mean().item()
    opt = torch.optim.SGD([z], lr=200.0)
    for _ in range(30):  # gradient descent on the acceptance loss alone
        opt.zero_grad()
        D.distill_rows(z, t, index, 1.0, 1.0).mean().backward()
        opt.step()
    assert D.distill_rows(z, t, index, 1.0, 1.0).mean().item() < before - 0.2


def test_bad_mix_and_temperature_are_named():
    z, t, index = case(rows=4)
    with pytest.raises(ValueError, match="mix"):
        D.distill_rows(z, t, index, 1.0, 1.5)
    with pytest.raises(ValueError, match="temperature"):
        D.distill_rows(z, t, index, 0.0, 0.5)


# ---- the fused loss (train.distill_kernel: torch): value and gradient in one pass -----------------


def fused_against_rows(z, t, index, coef, T, mix, columns=None, scale=0.8):
    """-> (fused total, rows, grad; the same from distill_rows' weighted sum), both scaled by `scale` upstream."""
    ours, ref = z.detach().clone().requires_grad_(True), z.detach().clone().requires_grad_(True)
    total, rows = D.fused_distill(ours, t, index, coef, T, mix, columns)
    (total * scale).backward()
    ref_rows = D.distill_rows(ref, t, index, T, mix, columns)
    ref_total = (ref_rows * coef).sum()
    (ref_total * scale).backward()
    return (total, rows, ours.grad), (ref_total, ref_rows.detach(), ref.grad)


@pytest.mark.parametrize("mix, T", [(1.0, 1.0), (1.0, 0.7), (0.0, 1.0), (0.5, 0.7), (0.5, 1.0)])
def test_the_fused_loss_equals_the_rows_weighted_sum_value_and_gradient(mix, T):
    z, t, index = case(rows=150)  # three chunks of live rows
    coef = torch.rand(150, generator=torch.Generator().manual_seed(2))
    coef[::4] = 0  # unsupervised slots: skipped
    (total, rows, grad), (ref_total, ref_rows, ref_grad) = fused_against_rows(z, t, index, coef, T, mix)
    torch.testing.assert_close(total.double(), ref_total.double(), rtol=1e-6, atol=1e-6)
    live = coef > 0
    torch.testing.assert_close(rows[live].double(), ref_rows[live].double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(rows[~live], torch.zeros_like(rows[~live]))  # skipped rows are not computed
    assert torch.equal(grad[~live], torch.zeros_like(grad[~live]))
    assert ref_grad.abs().max() > 1e-3  # a gradient to compare
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6 * float(ref_grad.abs().max()))  # fp32 sums


def test_the_fused_loss_reads_a_loss_vocabularys_columns():
    z, t, index = case(V=37)
    columns = torch.tensor([0, 3, 5, 8, 13, 21, 34])
    coef = torch.full((150,), 1 / 150)
    (total, _, grad), (ref_total, _, ref_grad) = fused_against_rows(z.detach()[:, columns], t, index, coef, 0.7, 0.5,
                                                                   columns)
    torch.testing.assert_close(total.double(), ref_total.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6 * float(ref_grad.abs().max()))


def test_bf16_logits_keep_the_gradient_within_two_roundings_of_the_exact_one():
    """On bf16 logits the gradient is rounded once in the forward and once by the upstream scale; the
    reference rounds once (autograd's cast back): the two differ by at most ~2 bf16 ulps."""
    z, t, index = case(rows=96, V=300)
    zb = z.detach().to(torch.bfloat16)
    coef = torch.rand(96, generator=torch.Generator().manual_seed(4))
    (total, _, grad), (ref_total, _, ref_grad) = fused_against_rows(zb, t.float(), index, coef, 0.7, 0.5, scale=0.7)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2 ** -7, atol=1e-6 * float(ref_grad.abs().max()))


def test_weighted_distill_is_the_same_loss_by_every_torch_implementation():
    """weighted_distill (the train step's term) by rows and by the fused pass: equal value and gradient."""
    g = torch.Generator().manual_seed(5)
    B, T, V, N, Bk = 2, 12, 19, 3, 4
    target_logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(3, V, (B, T), generator=g)
    blocks = O.make_blocks(ids, torch.ones(B, T, dtype=torch.bool), N, Bk, 1, generator=g)
    mask = blocks.label_mask & (torch.rand(blocks.label_mask.shape, generator=g) > 0.3)
    logits = torch.randn(B, N, Bk, V, generator=g)
    index = D.block_teacher_index(blocks.positions, T)
    w = O.position_weights(Bk, 2.0)
    out = {}
    for kernel in ("rows", "torch"):
        x = logits.clone().requires_grad_(True)
        loss = D.weighted_distill(x, target_logits, index, mask, w, 0.7, 0.5, kernel=kernel)
        out[kernel] = (loss, *torch.autograd.grad(loss * 0.6, x))
    for ours, ref in zip(out["torch"], out["rows"]):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_the_distill_switch_keeps_torch_off_cuda_and_refuses_triton_where_it_cannot_run(monkeypatch):
    """train.distill_kernel: auto off CUDA is the fused torch pass, rows and torch are themselves; triton on
    a CPU without the interpreter is a UserError that names the key (the kernel: tests/kernels/test_distill_kernel.py)."""
    from dominospec.errors import UserError

    cpu = torch.device("cpu")
    assert [D.distill_kernel(k, cpu) for k in ("auto", "torch", "rows")] == ["torch", "torch", "rows"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="train.distill_kernel: triton cannot run on cpu"):
        D.distill_kernel("triton", cpu)
