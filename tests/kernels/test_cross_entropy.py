"""kernels.cross_entropy against its reference: per-row F.cross_entropy(logits.float()) and its gradient.

Losses: 1e-5 of max|loss| in both dtypes (bf16 inputs are upcast exactly, kernel and reference both do
fp32 arithmetic; observed ~1e-7 relative: summation order only). Gradients, elementwise: rtol 1e-5 in
fp32; in bf16 one ulp (rtol 2^-7), because both round the same fp32 value once, the GPU to nearest and
Triton's interpreter toward zero; atol 1e-6 of max|grad| for entries near 0.
Run: python -m pytest tests/kernels/test_cross_entropy.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.cross_entropy import INTERPRET_BLOCK_V, available, cross_entropy, cross_entropy_reference
from dominospec.train.chunked_ce import chunked_cross_entropy

TOL = 1e-5
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}
DTYPES = [torch.float32, torch.bfloat16]
VOCABS = [7, 1000, 4099]  # interpreter BLOCK_V 1024: two rows narrower than a chunk, one of 4 chunks + 3
assert 1000 < INTERPRET_BLOCK_V < 4099 and 4099 % INTERPRET_BLOCK_V


def make(N, V, dtype, seed=0):
    """-> logits [N, V] (scale 3) in dtype, labels [N], g [N] with exact zeros in every third row."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=gen)).to(DEVICE, dtype)
    labels = torch.randint(0, V, (N,), generator=gen).to(DEVICE)
    g = torch.randn(N, generator=gen)
    g[::3] = 0.0
    return logits, labels, g.to(DEVICE)


def grads(fn, logits, labels, g):
    """-> d (fn(logits, labels) · g).sum() / d logits, in the logits' dtype."""
    x = logits.clone().requires_grad_()
    return torch.autograd.grad((fn(x, labels) * g).sum(), x)[0]


def assert_grad_close(actual, expected):
    assert actual.dtype == expected.dtype
    atol = 1e-6 * float(expected.float().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=GRAD_RTOL[expected.dtype], atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("N", [1, 5, 33])
def test_losses_and_gradients_match_the_reference(N, V, dtype):
    logits, labels, g = make(N, V, dtype, seed=N * V)
    loss = cross_entropy(logits, labels)
    assert loss.dtype == torch.float32 and loss.shape == (N,)
    assert_close_scaled(loss, cross_entropy_reference(logits, labels), TOL)
    grad = grads(cross_entropy, logits, labels, g)
    assert_grad_close(grad, grads(cross_entropy_reference, logits, labels, g))
    assert torch.equal(grad[g == 0], torch.zeros_like(grad[g == 0]))  # skipped rows are written, as zeros
    assert N == 1 or grad.float().abs().max() > 1e-2  # the comparison is not between zeros


def test_strided_rows_and_a_plain_sum():
    """A column slice (row stride > V) and `.sum().backward()` (an expanded, stride-0 g)."""
    wide, labels, _ = make(6, 1500, torch.bfloat16, seed=1)
    logits = wide[:, 200:1300]  # [6, 1100], row stride 1500
    labels = labels % 1100
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    cross_entropy(ours[:, :], labels).sum().backward()
    cross_entropy_reference(ref, labels).sum().backward()
    assert_close_scaled(cross_entropy(logits, labels), cross_entropy_reference(logits, labels), TOL)
    assert_grad_close(ours.grad, ref.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits_stay_finite(dtype):
    """One logit of 1e4 and -inf elsewhere (whole chunks, and lanes -inf throughout); labels 0 and V-1."""
    V = 4099
    logits, _, g = make(4, V, dtype, seed=2)
    logits[0] = float("-inf")
    logits[0, 0] = 1e4  # label 0 is the only finite logit: loss 0, gradient 0
    logits[1, : V - 5] = float("-inf")
    logits[1, V - 1] = 1e4
    logits[2, 17] = 1e4  # label V-1 far below the max: loss ≈ 1e4
    logits[3, 100:3000] = float("-inf")
    labels = torch.tensor([0, V - 1, V - 1, 0], device=DEVICE)
    g = torch.ones(4, device=DEVICE)
    loss, ref = cross_entropy(logits, labels), cross_entropy_reference(logits, labels)
    assert torch.isfinite(ref).all() and torch.isfinite(loss).all()
    assert_close_scaled(loss, ref, TOL)
    grad = grads(cross_entropy, logits, labels, g)
    assert torch.isfinite(grad).all()
    assert_grad_close(grad, grads(cross_entropy_reference, logits, labels, g))


def test_a_perturbed_input_fails_the_tolerance():
    """The tolerances can fail: a changed label, or a logit nudged by 1e-3, exceeds them."""
    logits, labels, g = make(5, 1000, torch.float32, seed=3)
    ref, ref_grad = cross_entropy_reference(logits, labels), grads(cross_entropy_reference, logits, labels, g)
    shifted = (labels + 1) % 1000
    with pytest.raises(AssertionError):
        assert_close_scaled(cross_entropy(logits, shifted), ref, TOL)
    with pytest.raises(AssertionError):
        assert_grad_close(grads(cross_entropy, logits, shifted, g), ref_grad)
    nudged = logits.clone()
    nudged[torch.arange(5), labels] += 1e-3
    with pytest.raises(AssertionError):
        assert_close_scaled(cross_entropy(nudged, labels), ref, TOL)
    with pytest.raises(AssertionError):  # bf16 too: its one-ulp gradient tolerance is not loose
        bf16 = logits.bfloat16()
        assert_grad_close(grads(cross_entropy, bf16, shifted, g), grads(cross_entropy_reference, bf16, labels, g))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_chunked_cross_entropy(dtype):
    """The torch path it replaces: same losses and gradients on the same input."""
    logits, labels, g = make(33, 4099, dtype, seed=4)
    assert_close_scaled(cross_entropy(logits, labels), chunked_cross_entropy(logits, labels), TOL)
    assert_grad_close(grads(cross_entropy, logits, labels, g), grads(chunked_cross_entropy, logits, labels, g))


def test_available_and_input_checks(monkeypatch):
    assert available(DEVICE) and available("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not available("cpu")
    logits, labels, _ = make(3, 7, torch.float32)
    with pytest.raises(AssertionError):
        cross_entropy(logits, labels.int())
    with pytest.raises(AssertionError):
        cross_entropy(logits, labels[:2])
    assert cross_entropy(logits[:0], labels[:0]).shape == (0,)


def test_the_domino_loss_on_the_kernel_equals_the_loss_on_the_torch_chunks():
    """The train stage's loss (`domino_loss`, base + final logits, slot weights, the curriculum's mix)
    with `ce=cross_entropy` (train.ce_kernel: triton) equals the default chunks: value and gradients."""
    from dominospec.train.chunked_ce import row_cross_entropy
    from dominospec.train.objective import domino_loss, position_weights

    gen = torch.Generator().manual_seed(7)
    base = (3 * torch.randn(6, 4, 1000, generator=gen)).to(DEVICE)
    final = (3 * torch.randn(6, 4, 1000, generator=gen)).to(DEVICE)
    labels = torch.randint(0, 1000, (6, 4), generator=gen).to(DEVICE)
    mask = (torch.rand(6, 4, generator=gen) > 0.3).to(DEVICE)
    w = position_weights(4, 2.0)
    assert row_cross_entropy("triton", torch.device(DEVICE)) is cross_entropy

    def run(ce):
        b, f = base.clone().requires_grad_(), final.clone().requires_grad_()
        loss = domino_loss(b, f, labels, mask, w, 0.3, ce=ce)[0]
        return (loss, *torch.autograd.grad(loss, (b, f)))

    for ours, ref in zip(run(cross_entropy), run(chunked_cross_entropy)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
