"""kernels.correction_sample against its reference: the corrected fp32 logits row and logsumexp(logits / T).

Tolerance 1e-5 of max|logit| (row) and of max|lse|, in fp32 and bf16 alike: bf16 inputs are upcast
exactly and both sides do fp32 arithmetic; only the summation order differs (observed ~1e-6).
Run: python -m pytest tests/kernels/test_correction_sample.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.correction_sample import correction_logits, correction_logits_reference

TOL = 1e-5


def make(N, V, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, r, generator=g)
    w2 = torch.randn(V, r, generator=g) / r ** 0.5
    base = torch.randn(N, V, generator=g) * 3
    return [t.to(DEVICE, dtype) for t in (h, w2, base)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("N, V, r, M", [(2, 203, 13, None), (1, 131, 9, 29), (3, 77, 5, 77)])
def test_row_and_logsumexp_match_reference(N, V, r, M, temperature, dtype):
    h, w2, base = make(N, V, r, dtype, seed=V)
    ids = None if M is None else torch.randperm(V, generator=torch.Generator().manual_seed(M))[:M].to(DEVICE)
    out = correction_logits(h, w2, base, ids, temperature=temperature, block_v=32, block_r=8)
    ref = correction_logits_reference(h, w2, base, ids, temperature)
    assert out.logits.dtype == torch.float32 and out.logits.shape == ref.logits.shape
    assert_close_scaled(out.logits, ref.logits, TOL)
    assert_close_scaled(out.lse, ref.lse, TOL)
    q = torch.exp(out.logits / temperature - out.lse[:, None])  # q without a second pass
    torch.testing.assert_close(q.sum(-1), torch.ones(N, device=DEVICE), atol=1e-5, rtol=0)


def test_a_perturbed_input_fails_the_tolerance():
    h, w2, base = make(2, 203, 13, torch.float32)
    ref = correction_logits_reference(h, w2, base)
    nudged = base.clone()
    nudged[0, 101] += 1e-3  # one logit, in the second block
    with pytest.raises(AssertionError):
        assert_close_scaled(correction_logits(h, w2, nudged, block_v=32, block_r=8).logits, ref.logits, TOL)


def test_temperature_must_be_positive():
    h, w2, base = make(1, 20, 4, torch.float32)
    with pytest.raises(ValueError):
        correction_logits(h, w2, base, temperature=0.0)
