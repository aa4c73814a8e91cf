"""The per-row decode attention (kernels.decode_attention) against its pure-torch reference.

Rows of very different lengths on one cache (1 column, a partial block, whole blocks, whole blocks
plus a partial one, the full capacity), fewer rows than slots; the columns past each row's length
hold large garbage, so a kernel that read them would fail. Tolerances as tree_attention's (relative
to max|expected|): fp32 1e-5 (online softmax vs one softmax), bf16 1.6e-2 (P and the output rounded
to bf16; the reference stays fp32 to the end).
Run: python -m pytest tests/kernels/test_decode_attention.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.decode_attention import BLOCK_N, decode_attention, decode_attention_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def _case(B, S, Hq, Hkv, C, D, seen, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(S, Hkv, C, D, generator=g)
    v = torch.randn(S, Hkv, C, D, generator=g)
    for b, n in enumerate(seen):  # garbage past each row's length: reading it would show
        k[b, :, n:] = 1e4
        v[b, :, n:] = -1e4
    return q, k.to(DEVICE, dtype), v.to(DEVICE, dtype), torch.tensor(seen, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq, Hkv, D", [(9, 3, 64), (4, 2, 16), (6, 1, 24)])  # SmolLM2's heads; tiny; D not a power of two
def test_decode_attention_matches_reference(Hq, Hkv, D, dtype):
    C = 2 * BLOCK_N + 16
    seen = [1, 37, BLOCK_N, 2 * BLOCK_N + 5, C]
    q, k, v, lengths = _case(len(seen), len(seen) + 2, Hq, Hkv, C, D, seen, dtype)
    scale = D ** -0.5
    out = decode_attention(q, k, v, lengths, scale)
    expected = decode_attention_reference(q, k, v, lengths, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out.float()).all()
    assert_close_scaled(out, expected, TOL[dtype])


def test_decode_attention_reads_each_rows_own_length():
    """A row's output changes when its own length does and not when another row's does (a wrong
    length or a shared one fails)."""
    q, k, v, lengths = _case(3, 3, 4, 2, BLOCK_N + 8, 16, [5, 40, BLOCK_N + 8], torch.float32, seed=1)
    k[:, :, :] = torch.randn(k.shape, generator=torch.Generator().manual_seed(2)).to(k)  # no garbage: every column real
    base = decode_attention(q, k, v, lengths, 0.25)
    longer = decode_attention(q, k, v, torch.tensor([6, 40, BLOCK_N + 8], device=DEVICE), 0.25)
    assert not torch.allclose(base[0], longer[0]) and torch.equal(base[1:], longer[1:])
    assert_close_scaled(base, decode_attention_reference(q, k, v, lengths, 0.25), TOL[torch.float32])


@pytest.mark.parametrize("block_n, num_warps", [(16, 2), (128, 8)])
def test_decode_attention_knobs_keep_the_result(block_n, num_warps):
    """Other column blocks and warps (the benchmark's rows:BLOCK_N:WARPS) compute the same attention."""
    seen = [1, 17, 128, 200]
    q, k, v, lengths = _case(4, 4, 9, 3, 256, 64, seen, torch.float32, seed=3)
    out = decode_attention(q, k, v, lengths, 0.125, block_n=block_n, num_warps=num_warps)
    assert_close_scaled(out, decode_attention_reference(q, k, v, lengths, 0.125), TOL[torch.float32])
