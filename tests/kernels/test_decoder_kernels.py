"""The lean decoder's kernels against their references: rms_norm, silu_mul, rope_cache, tree_attention.

Tolerances (relative to max|expected|, kernel_helpers.assert_close_scaled):
- rms_norm, silu_mul, rope_cache round exactly where HF's eager ops round, so bf16 results are
  bitwise equal but for rare one-ulp flips of a different fp32 summation order (mean(x²)) or exp
  (we require >= 99 % of the elements bitwise equal and all within 8e-3, about one bf16 ulp); fp32
  within 2e-6 (a few fp32 ulps: summation order, exp's last bit).
- tree_attention: fp32 1e-5 (online softmax + blocked sums vs one softmax); bf16 1.6e-2: the output
  is stored in bf16 (an ulp is 2^-8 of the value) and P is rounded to bf16 for P·V (HF's eager
  attention rounds it too), while the reference stays fp32 to the end. Each case runs unsplit, with
  the column range split in 3 runs of >= 1 block (partials merged by the last program; more runs
  than blocks leave some empty) and of >= 4 blocks (a short context: one run writes out directly),
  the workspace reused for a second launch (its counters reset).
Each kernel also has a check that a wrong input (mask, slot, rounding order, gate/up order) fails.
Run: python -m pytest tests/kernels/test_decoder_kernels.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, assert_close_scaled

from dominospec.kernels.rms_norm import rms_norm, rms_norm_reference
from dominospec.kernels.rope_cache import rope_cache, rope_cache_reference
from dominospec.kernels.silu_mul import silu_mul, silu_mul_reference
from dominospec.kernels.tree_attention import (
    bits_from_visible,
    causal_bits,
    tree_attention,
    tree_attention_reference,
    tree_attention_workspace,
    visible_from_bits,
)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def assert_matches(actual, expected, dtype):
    """Within TOL; in bf16 also (nearly) bitwise, which only the same rounding order achieves."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert_close_scaled(actual, expected, TOL[dtype])
    if dtype == torch.bfloat16:
        assert (actual == expected).float().mean() >= 0.99


# ---- rms_norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("N, H", [(3, 576), (4, 40)])  # SmolLM2's hidden size; H not a power of two
def test_rms_norm_matches_reference(N, H, with_residual, dtype):
    x = randn(N, H, dtype=dtype, seed=1)
    weight = randn(H, dtype=dtype, seed=2)
    residual = randn(N, H, dtype=dtype, seed=3, scale=4.0) if with_residual else None
    out, summed = rms_norm(x, weight, 1e-5, residual)
    expected, expected_sum = rms_norm_reference(x, weight, 1e-5, residual)
    assert_matches(out, expected, dtype)
    assert torch.equal(summed, expected_sum)
    if not with_residual:
        assert summed is x  # no copy


def test_rms_norm_strided_rows():
    wide = randn(5, 576 + 24, dtype=torch.bfloat16, seed=4)
    x, residual = wide[:, :576], randn(10, 576, dtype=torch.bfloat16, seed=5)[::2]  # row strides 600, 1152
    weight = randn(576, dtype=torch.bfloat16, seed=6)
    out, summed = rms_norm(x, weight, 1e-6, residual)
    expected, expected_sum = rms_norm_reference(x, weight, 1e-6, residual)
    assert_matches(out, expected, torch.bfloat16)
    assert torch.equal(summed, expected_sum)


def test_rms_norm_rounding_order_is_observable():
    """In bf16, skipping the rounding of n before the weight (or of the sum) changes the output: the
    bitwise check above can tell the orders apart."""
    x, weight = randn(4, 576, dtype=torch.bfloat16, seed=7), randn(576, dtype=torch.bfloat16, seed=8)
    residual = randn(4, 576, dtype=torch.bfloat16, seed=9, scale=4.0)
    out, _ = rms_norm(x, weight, 1e-5, residual)
    s = residual.float() + x.float()  # the sum not rounded
    unrounded = (weight.float() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_matches(out, unrounded, torch.bfloat16)


# ---- silu_mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, I, block", [(2, 1536, 1024), (3, 37, 16)])  # SmolLM2's I; I not a multiple of the block
def test_silu_mul_matches_reference(N, I, block, dtype):
    gate_up = randn(N, 2 * I, dtype=dtype, seed=10, scale=3.0)
    out = silu_mul(gate_up, block=block)
    assert out.shape == (N, I)
    assert_matches(out, silu_mul_reference(gate_up), dtype)


def test_silu_mul_strided_rows_and_gate_first():
    wide = randn(3, 2 * 37 + 5, dtype=torch.float32, seed=11, scale=3.0)
    gate_up = wide[:, :74]
    out = silu_mul(gate_up, block=16)
    assert_close_scaled(out, F.silu(gate_up[:, :37]) * gate_up[:, 37:], TOL[torch.float32])
    with pytest.raises(AssertionError):  # up first would be another result
        assert_close_scaled(out, F.silu(gate_up[:, 37:]) * gate_up[:, :37], TOL[torch.float32])


# ---- rope_cache -------------------------------------------------------------------------------


def rotary(T, D, first_position, dtype, base=10000.0):
    """HF's cos, sin [T, D] (rotate-half layout) for positions first_position .. +T-1, in `dtype`."""
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = (torch.arange(T, dtype=torch.float32) + first_position)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


ROPE_SHAPES = [  # T, Hq, Hkv, D, qk_norm
    (3, 9, 3, 64, False),  # SmolLM2 (Llama): no q/k norm
    (5, 4, 2, 32, True),  # Qwen3-like: per-head RMSNorm before the rotation
]


def rope_case(T, Hq, Hkv, D, qk_norm, dtype, C=16, slot=7):
    qkv = randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, seed=12, scale=2.0)
    cos, sin = rotary(T, D, slot, dtype)
    norms = (randn(D, dtype=dtype, seed=13), randn(D, dtype=dtype, seed=14)) if qk_norm else (None, None)
    cache = torch.full((Hkv, C, D), 123.0, dtype=dtype, device=DEVICE)  # a sentinel in untouched rows
    return qkv, cos, sin, cache, norms, torch.tensor(slot, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, Hq, Hkv, D, qk_norm", ROPE_SHAPES)
def test_rope_cache_matches_reference(T, Hq, Hkv, D, qk_norm, dtype):
    qkv, cos, sin, cache, (qn, kn), slot = rope_case(T, Hq, Hkv, D, qk_norm, dtype)
    k_cache, v_cache, k_ref, v_ref = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    q = rope_cache(qkv, cos, sin, k_cache, v_cache, slot, Hq, Hkv, qn, kn)
    q_ref = rope_cache_reference(qkv, cos, sin, k_ref, v_ref, slot, Hq, Hkv, qn, kn)
    assert q.shape == (T, Hq, D) and q.is_contiguous()
    if not qk_norm:  # no reduction: the same roundings give the same bits, fp32 included
        assert torch.equal(q, q_ref) and torch.equal(k_cache, k_ref)
    assert_matches(q, q_ref, dtype)
    assert_matches(k_cache, k_ref, dtype)
    assert torch.equal(v_cache, v_ref)  # a copy
    assert torch.equal(k_cache[:, :7], cache[:, :7]) and torch.equal(k_cache[:, 7 + T:], cache[:, 7 + T:])


def test_rope_cache_reads_slot_and_rotation_from_its_inputs():
    T, Hq, Hkv, D = 3, 4, 2, 32
    qkv, cos, sin, cache, _, slot = rope_case(T, Hq, Hkv, D, False, torch.float32)
    k_ref, v_ref = cache.clone(), cache.clone()
    q_ref = rope_cache_reference(qkv, cos, sin, k_ref, v_ref, slot, Hq, Hkv)
    k_cache, v_cache = cache.clone(), cache.clone()
    rope_cache(qkv, cos, sin, k_cache, v_cache, slot + 1, Hq, Hkv)  # another slot: other rows
    assert not torch.equal(k_cache, k_ref) and not torch.equal(v_cache, v_ref)
    q = rope_cache(qkv, sin, cos, cache.clone(), cache.clone(), slot, Hq, Hkv)  # cos and sin swapped
    assert not torch.allclose(q, q_ref)


# ---- tree_attention ---------------------------------------------------------------------------


def tree_bits(parents):
    """parents[i] < i (-1 for the root) -> [T, W] int64 bitmasks: row i sees itself and its ancestors."""
    T = len(parents)
    visible = torch.eye(T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i] |= visible[p]
    return bits_from_visible(visible.to(DEVICE))


def random_bits(T, seed):
    g = torch.Generator().manual_seed(seed)
    visible = (torch.rand(T, T, generator=g) < 0.4) | torch.eye(T, dtype=torch.bool)
    visible[T - 1, :] = True  # bit 63 of every word set in the last row (and some rows see later rows)
    visible[:, T - 1] |= torch.rand(T, generator=g) < 0.5
    return bits_from_visible(visible.to(DEVICE))


BRANCHES = [-1, 0, 1, 2, 0, 4, 0, 6, 7, 1]  # three branches off row 0, one forking at row 1


def wide_tree(T, seed):
    """A random tree of T rows whose parents lie up to 80 rows back (paths cross word boundaries)."""
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(max(0, i - 80), i, (1,), generator=g)) for i in range(1, T)]


ATTN_CASES = [  # T, Hq, Hkv, D, start, bits
    (1, 9, 3, 64, 70, lambda: causal_bits(1, DEVICE)),  # SmolLM2 decode step: a ragged context tail
    (len(BRANCHES), 4, 2, 32, 130, lambda: tree_bits(BRANCHES)),  # tree over 2 full context blocks + tail
    (64, 4, 2, 32, 0, lambda: causal_bits(64, DEVICE)),  # prefill: no context, bit 63
    (64, 4, 2, 32, 37, lambda: random_bits(64, 15)),  # any mask (not a tree), bit 63, tree spans 2 blocks
    (9, 2, 2, 16, 64, lambda: tree_bits(BRANCHES[:9])),  # Hq == Hkv, context of exactly one block
    (6, 4, 2, 8, 20, lambda: tree_bits(BRANCHES[:6])),  # head_dim 8 (tiny test models): padded to 16
    (3, 2, 1, 24, 5, lambda: causal_bits(3, DEVICE)),  # head_dim not a power of two
    (17, 4, 1, 128, 45, lambda: random_bits(17, 7)),  # Qwen3's head_dim: its default block of 32 columns
    (65, 3, 1, 16, 10, lambda: causal_bits(65, DEVICE)),  # the first row of a second word
    (200, 3, 1, 16, 90, lambda: tree_bits(wide_tree(200, 3))),  # 4 words, G = 3: 10 tiles
    (320, 2, 1, 16, 0, lambda: random_bits(320, 16)),  # the widest verify, any mask, no context
]


def attn_case(T, Hq, Hkv, D, start, dtype, extra=11, seed=20):
    """q, and caches of capacity start + T + extra whose rows past start + T are garbage (NaN, 1e30)."""
    C = start + T + extra
    q = randn(T, Hq, D, dtype=dtype, seed=seed, scale=2.0)
    k_cache = randn(Hkv, C, D, dtype=dtype, seed=seed + 1)
    v_cache = randn(Hkv, C, D, dtype=dtype, seed=seed + 2)
    k_cache[:, start + T:] = float("nan")
    v_cache[:, start + T:] = 1e30
    return q, k_cache, v_cache, torch.tensor(start, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, Hq, Hkv, D, start, bits", ATTN_CASES)
def test_tree_attention_matches_reference(T, Hq, Hkv, D, start, bits, dtype):
    q, k_cache, v_cache, start_t = attn_case(T, Hq, Hkv, D, start, dtype)
    visible = bits()
    expected = tree_attention_reference(q, k_cache, v_cache, start_t, visible, D ** -0.5)
    assert torch.isfinite(expected).all()
    knobs = [dict(splits=1, min_span=1, block_n=64), dict(splits=3, min_span=1, block_n=64), dict(splits=3, min_span=4),
             dict(splits=3, min_span=1, block_n=32), dict(splits=2, min_span=1, block_n=16, block_m=32)]
    for knob in knobs:
        workspace = tree_attention_workspace(T, Hq, Hkv, D, DEVICE, **knob)
        out = tree_attention(q, k_cache, v_cache, start_t, visible, D ** -0.5, workspace)
        assert out.shape == (T, Hq, D) and out.dtype == dtype
        assert_close_scaled(out, expected, ATTN_TOL[dtype])
        assert torch.equal(tree_attention(q, k_cache, v_cache, start_t, visible, D ** -0.5, workspace), out)
        assert not workspace.counters.any()


def test_tree_attention_workspace_refuses_a_tile_that_is_no_power_of_two():
    for block_m in (8, 24, 48):
        with pytest.raises(ValueError, match=f"block_m must be a power of two >= 16, got {block_m}"):
            tree_attention_workspace(4, 4, 2, 32, DEVICE, block_m=block_m)


def test_tree_attention_ignores_the_capacity():
    """The same context in a cache of capacity start + T and in one 100 rows longer (garbage past
    start + T): the same bits out."""
    T, Hq, Hkv, D, start = len(BRANCHES), 4, 2, 32, 75
    q, k_long, v_long, start_t = attn_case(T, Hq, Hkv, D, start, torch.bfloat16, extra=100)
    visible = tree_bits(BRANCHES)
    k_short, v_short = k_long[:, :start + T].clone(), v_long[:, :start + T].clone()
    for splits in (1, 2):
        workspace = tree_attention_workspace(T, Hq, Hkv, D, DEVICE, splits=splits, min_span=1)
        short = tree_attention(q, k_short, v_short, start_t, visible, D ** -0.5, workspace)
        long = tree_attention(q, k_long, v_long, start_t, visible, D ** -0.5, workspace)
        assert torch.isfinite(long).all() and torch.equal(short, long)


def test_tree_attention_follows_the_mask_and_start():
    T, Hq, Hkv, D, start = len(BRANCHES), 4, 2, 32, 20
    q, k_cache, v_cache, start_t = attn_case(T, Hq, Hkv, D, start, torch.float32)
    visible = tree_bits(BRANCHES)
    out = tree_attention(q, k_cache, v_cache, start_t, visible, D ** -0.5)
    wrong = visible.clone()
    wrong[3, 0] ^= 1 << 4  # row 3 also sees row 4 (another branch)
    changed = tree_attention(q, k_cache, v_cache, start_t, wrong, D ** -0.5)
    assert torch.equal(changed[:3], out[:3]) and torch.equal(changed[4:], out[4:])
    assert (changed[3] - out[3]).abs().max() > 1e-3
    k2 = k_cache.clone()
    k2[:, start + 4] = k2[:, start + 4] * 3  # row 4's key: rows that see it change, the others not
    moved = tree_attention(q, k2, v_cache, start_t, visible, D ** -0.5)
    sees_4 = ((visible[:, 0] >> 4) & 1).bool()
    assert torch.equal(moved[~sees_4], out[~sees_4]) and not torch.allclose(moved[sees_4], out[sees_4])
    earlier = tree_attention(q, k_cache, v_cache, start_t - 1, visible, D ** -0.5)  # start read on device
    assert not torch.allclose(earlier, out)


def test_tree_attention_reference_agrees_with_sdpa():
    """The reference's mask and GQA mapping, checked against torch's SDPA with an explicit bool mask."""
    T, Hq, Hkv, D, start = len(BRANCHES), 4, 2, 32, 9
    q, k_cache, v_cache, start_t = attn_case(T, Hq, Hkv, D, start, torch.float32)
    visible = tree_bits(BRANCHES)
    mask = torch.cat([torch.ones(T, start, dtype=torch.bool, device=DEVICE), visible_from_bits(visible)], 1)
    k = k_cache[:, :start + T].repeat_interleave(Hq // Hkv, 0)
    v = v_cache[:, :start + T].repeat_interleave(Hq // Hkv, 0)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=D ** -0.5).transpose(0, 1)
    assert_close_scaled(tree_attention_reference(q, k_cache, v_cache, start_t, visible, D ** -0.5), sdpa, 1e-5)


def test_bitmask_helpers():
    bits = causal_bits(64, DEVICE)
    assert bits.dtype == torch.int64 and bits.shape == (64, 1)
    assert bits[0, 0] == 1 and bits[1, 0] == 3 and bits[62, 0] == 2 ** 63 - 1 and bits[63, 0] == -1  # bit 63: the sign
    assert torch.equal(visible_from_bits(bits), torch.ones(64, 64, dtype=torch.bool, device=DEVICE).tril())
    wide = causal_bits(130, DEVICE)
    assert wide.shape == (130, 3) and wide[64].tolist() == [-1, 1, 0] and wide[129].tolist() == [-1, -1, 3]
    assert torch.equal(visible_from_bits(wide), torch.ones(130, 130, dtype=torch.bool, device=DEVICE).tril())
    assert torch.equal(visible_from_bits(bits[:, 0]), visible_from_bits(bits))  # [T]: one word a row
    g = torch.Generator().manual_seed(0)
    for T in (17, 64, 129):
        visible = (torch.rand(T, T, generator=g) < 0.5).to(DEVICE)
        assert torch.equal(visible_from_bits(bits_from_visible(visible)), visible)
    assert bits_from_visible(visible, words=5).shape == (129, 5)
