"""kernels.distill against its reference: the per-row acceptance + kd loss through autograd in fp32, and the
train step's term on the kernel against the fused torch pass.

Losses: 1e-5 of max|row| (fp32 arithmetic in both, summation order only). Gradients, elementwise: rtol 1e-5
in fp32; in bf16 one ulp (rtol 2^-7: both round one fp32 value once, the interpreter toward zero), atol 1e-6
of max|grad| for entries near 0. Rows with weight 0 read nothing and get a zero gradient.
Run: python -m pytest tests/kernels/test_distill_kernel.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.cross_entropy import INTERPRET_BLOCK_V
from dominospec.kernels.distill import distill_forward, distill_reference
from dominospec.train import distill as D

GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}
assert 2 * INTERPRET_BLOCK_V < 2500 < 3 * INTERPRET_BLOCK_V  # three chunks, a ragged last one


def make(N, V, R, dtype, seed=0):
    """-> logits [N, V] (scale 3) in dtype, teacher [R, V] in dtype, index [N], weights c [N] with zeros."""
    gen = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(N, V, generator=gen)).to(DEVICE, dtype)
    t = (3 * torch.randn(R, V, generator=gen)).to(DEVICE, dtype)
    index = torch.randint(0, R, (N,), generator=gen).to(DEVICE)
    coef = torch.rand(N, generator=gen)
    coef[::3] = 0.0
    return z, t, index, coef.to(DEVICE)


def reference_grad(z, t, index, coef, T, mix):
    """-> (rows [N] fp32, d sum(c * rows) / d z in z's dtype) by autograd through `distill_reference`."""
    x = z.clone().requires_grad_()
    rows = distill_reference(x, t, index, T, mix)
    return rows.detach(), torch.autograd.grad((rows * coef).sum(), x)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix, T", [(1.0, 0.7), (0.0, 1.0), (0.5, 0.7)])
@pytest.mark.parametrize("V", [7, 2500])
def test_rows_and_gradients_match_the_reference(V, mix, T, dtype):
    z, t, index, coef = make(9, V, 5, dtype, seed=V)
    lse = D.teacher_logsumexp(t, T)
    rows, grad = distill_forward(z, t, index, lse, coef, T, mix, grad=True)
    ref_rows, ref_grad = reference_grad(z, t, index, coef, T, mix)
    live = coef > 0
    assert_close_scaled(rows[live], ref_rows[live], 1e-5)
    assert torch.equal(rows[~live], torch.zeros_like(rows[~live]))
    assert grad.dtype == dtype and torch.equal(grad[~live], torch.zeros_like(grad[~live]))
    assert ref_grad.float().abs().max() > 1e-4  # the comparison is not between zeros
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=GRAD_RTOL[dtype],
                               atol=1e-6 * float(ref_grad.float().abs().max()))


def test_strided_rows_and_no_gradient_when_none_is_wanted():
    z, t, index, coef = make(6, 2500, 4, torch.float32, seed=3)
    wide = torch.zeros(6, 2600, device=DEVICE)
    wide[:, :2500] = z
    lse = D.teacher_logsumexp(t, 0.7)
    rows, grad = distill_forward(wide[:, :2500], t, index, lse, coef, 0.7, 0.5, grad=False)
    assert grad is None
    assert_close_scaled(rows, distill_reference(z, t, index, 0.7, 0.5) * (coef > 0), 1e-5)


def test_the_train_steps_term_on_the_kernel_equals_the_fused_torch_pass():
    """`weighted_distill` with kernel triton and torch inside `domino_loss` (base + final, the curriculum's
    mix, a loss vocabulary's columns): value and gradients."""
    from dominospec.train.objective import domino_loss, position_weights

    gen = torch.Generator().manual_seed(7)
    base = (3 * torch.randn(6, 4, 1500, generator=gen)).to(DEVICE)
    final = (3 * torch.randn(6, 4, 1500, generator=gen)).to(DEVICE)
    target = (3 * torch.randn(2, 9, 1600, generator=gen)).to(DEVICE)
    index = torch.randint(0, 18, (24,), generator=gen).to(DEVICE)
    columns = torch.randperm(1600, generator=gen)[:1500].to(DEVICE)
    mask = (torch.rand(6, 4, generator=gen) > 0.3).to(DEVICE)
    w = position_weights(4, 2.0)
    assert D.distill_kernel("triton", torch.device(DEVICE)) == "triton"

    def run(kernel):
        b, f = base.clone().requires_grad_(), final.clone().requires_grad_()
        term = lambda x: D.weighted_distill(x, target, index, mask, w, 0.7, 0.5, columns, kernel)  # noqa: E731
        loss = domino_loss(b, f, None, mask, w, 0.3, distill=term)[0]
        return (loss, *torch.autograd.grad(loss, (b, f)))

    for ours, ref in zip(run("triton"), run("torch")):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
