"""kernels.gru_cell against its reference: odd shapes, fp32 and bf16, table and GEMV inputs.

Tolerances (relative to max|s'|): fp32 1e-5, the kernel's only difference being fp32 summation
order over G and H terms (observed ~3e-7); bf16 8e-3, since s' is stored in bf16 (half an ulp is
2^-9 of the value, one ulp 2^-8 ≈ 3.9e-3) while the reference rounds once from fp32; twice that
with the bf16 table, whose gates gi are themselves rounded to bf16 before the nonlinearities.
Run: python -m pytest tests/kernels/test_gru_cell.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.gru_cell import gru_cell, gru_cell_reference, gru_table_bytes, gru_weights

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
SHAPES = [  # V, H, G, N, block_g, block_k: G and H not multiples of the blocks
    (203, 37, 19, 3, 8, 16),
    (61, 20, 33, 1, 16, 32),
    (17, 9, 5, 2, 8, 16),
]


def make(V, H, G, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    w_ih = torch.randn(3 * G, H, generator=g) / H ** 0.5
    w_hh = torch.randn(3 * G, G, generator=g) / G ** 0.5
    token = torch.randint(0, V, (N,), generator=g)
    state = torch.randn(N, G, generator=g).tanh()
    return [t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE) for t in (embed, w_ih, w_hh, token, state)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_table", [True, False])
@pytest.mark.parametrize("V, H, G, N, block_g, block_k", SHAPES)
def test_gru_cell_matches_reference(V, H, G, N, block_g, block_k, use_table, dtype):
    embed, w_ih, w_hh, token, state = make(V, H, G, N, dtype)
    weights = gru_weights(embed, w_ih, w_hh, table_budget_bytes=1 << 40 if use_table else 0)
    assert (weights.table is not None) == use_table
    out = gru_cell(token, state, weights, block_g=block_g, block_k=block_k)
    assert out.dtype == dtype and out.shape == (N, G)
    # the reference reads E and W_ih in fp32 even when the kernel gathers the (dtype-rounded) table
    expected = gru_cell_reference(token, state.float(), w_hh.float(), embed=embed.float(), w_ih=w_ih.float())
    assert_close_scaled(out, expected, TOL[dtype] if not use_table or dtype == torch.float32 else 2 * TOL[dtype])


def test_table_is_chosen_by_the_budget():
    embed, w_ih, w_hh, _, _ = make(203, 37, 19, 1, torch.float32)
    need = gru_table_bytes(203, 19, torch.float32)
    assert need == 203 * 3 * 19 * 4
    assert gru_weights(embed, w_ih, w_hh, need).table is not None
    assert gru_weights(embed, w_ih, w_hh, need - 1).table is None
    table = gru_weights(embed, w_ih, w_hh, need, chunk_rows=50).table  # built in ragged row chunks
    torch.testing.assert_close(table, embed @ w_ih.t(), rtol=1e-6, atol=1e-5)


def test_a_perturbed_input_fails_the_tolerance():
    """The fp32 tolerance can fail: a 1e-3 nudge of one state element is caught."""
    embed, w_ih, w_hh, token, state = make(203, 37, 19, 3, torch.float32)
    weights = gru_weights(embed, w_ih, w_hh, 0)
    expected = gru_cell_reference(token, state, w_hh, embed=embed, w_ih=w_ih)
    assert_close_scaled(gru_cell(token, state, weights, block_g=8, block_k=16), expected, TOL[torch.float32])
    nudged = state.clone()
    nudged[1, 4] += 1e-3
    with pytest.raises(AssertionError):
        assert_close_scaled(gru_cell(token, nudged, weights, block_g=8, block_k=16), expected, TOL[torch.float32])


def test_out_must_not_alias_state():
    embed, w_ih, w_hh, token, state = make(17, 9, 5, 2, torch.float32)
    with pytest.raises(AssertionError):
        gru_cell(token, state, gru_weights(embed, w_ih, w_hh, 0), out=state)
