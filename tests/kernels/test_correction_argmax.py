"""kernels.correction_argmax against its reference: split-vocabulary argmax of u + W2 · SiLU(h).

Tokens must be exact (ties: the lowest index, as torch.argmax). best and lse: 1e-5 of max|logit|
in both dtypes, because bf16 inputs are upcast exactly and kernel and reference both do fp32
arithmetic (observed ~1e-6 relative: summation order only).
Run: python -m pytest tests/kernels/test_correction_argmax.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.correction_argmax import correction_argmax, correction_argmax_reference

TOL = 1e-5
SHAPES = [  # N rows, V, r, block_v, block_r: V and r not multiples of the blocks
    (3, 203, 13, 32, 8),
    (1, 517, 37, 128, 16),
    (2, 64, 8, 64, 8),  # one exact block
    (1, 5, 3, 16, 4),  # fewer columns than one block
]


def make(N, V, r, dtype, seed=0, base_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, r, generator=g)
    w2 = torch.randn(V, r, generator=g) / r ** 0.5
    base = torch.randn(N, V, generator=g) * base_scale
    return [t.to(DEVICE, dtype) for t in (h, w2, base)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, V, r, block_v, block_r", SHAPES)
def test_full_vocabulary_matches_reference(N, V, r, block_v, block_r, dtype):
    h, w2, base = make(N, V, r, dtype)
    out = correction_argmax(h, w2, base, block_v=block_v, block_r=block_r)
    ref = correction_argmax_reference(h, w2, base)
    assert out.token.tolist() == ref.token.tolist()
    assert_close_scaled(out.best, ref.best, TOL)
    assert_close_scaled(out.lse, ref.lse, TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 7, 50])
def test_pool_matches_reference(M, dtype):
    N, V, r = 2, 203, 13
    h, w2, base = make(N, V, r, dtype, seed=M)
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(M))[:M].to(DEVICE)
    out = correction_argmax(h, w2, base, ids, block_v=16, block_r=8)
    ref = correction_argmax_reference(h, w2, base, ids)
    assert out.token.tolist() == ref.token.tolist()
    assert set(out.token.tolist()) <= set(ids.tolist())
    assert_close_scaled(out.best, ref.best, TOL)
    assert_close_scaled(out.lse, ref.lse, TOL)


def test_pool_of_the_whole_vocabulary_is_the_full_vocabulary():
    """M = V: in id order the result is identical; in any order (as topk returns it) the token is the same."""
    N, V, r = 3, 203, 13
    h, w2, base = make(N, V, r, torch.float32, seed=5)
    full = correction_argmax(h, w2, base, block_v=32, block_r=8)
    in_order = correction_argmax(h, w2, base, torch.arange(V, device=DEVICE), block_v=32, block_r=8)
    shuffled = correction_argmax(h, w2, base, torch.randperm(V).to(DEVICE), block_v=32, block_r=8)
    for pooled in (in_order, shuffled):
        assert pooled.token.tolist() == full.token.tolist()
        assert_close_scaled(pooled.lse, full.lse, TOL)
    assert torch.equal(in_order.best, full.best)


def test_ties_pick_the_lowest_index():
    """Equal maxima in different blocks and inside one block: the lowest column wins, as torch.argmax."""
    V, r = 100, 4
    h = torch.zeros(1, r, device=DEVICE)  # SiLU(0) = 0: logits = base exactly
    w2 = torch.randn(V, r, device=DEVICE)
    base = torch.zeros(1, V, device=DEVICE)
    base[0, [37, 38, 70, 99]] = 2.0  # block_v 16: blocks 2, 4 and 6
    out = correction_argmax(h, w2, base, block_v=16, block_r=4)
    assert out.token.item() == 37 == base.argmax().item()
    ids = torch.tensor([99, 5, 70, 37], device=DEVICE)  # pool: the first position of the max
    assert correction_argmax(h, w2, base, ids, block_v=2, block_r=4).token.item() == 99


def test_saturated_logits_keep_a_finite_logsumexp():
    """Base logits of ±30 scale: the pieces are combined in max-shifted form, no overflow."""
    h, w2, base = make(2, 203, 13, torch.float32, seed=3, base_scale=30.0)
    out = correction_argmax(h, w2, base, block_v=32, block_r=8)
    ref = correction_argmax_reference(h, w2, base)
    assert torch.isfinite(out.lse).all()
    assert out.token.tolist() == ref.token.tolist()
    assert_close_scaled(out.lse, ref.lse, TOL)


def test_a_perturbed_input_fails_the_tolerance():
    """The tolerance can fail: nudging h by 1e-3 moves the logits by more than 1e-5 of their scale."""
    h, w2, base = make(3, 203, 13, torch.float32)
    ref = correction_argmax_reference(h, w2, base)
    with pytest.raises(AssertionError):
        assert_close_scaled(correction_argmax(h + 1e-3, w2, base, block_v=32, block_r=8).lse, ref.lse, TOL)
