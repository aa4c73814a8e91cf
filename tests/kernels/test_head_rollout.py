"""kernels.head_rollout (the whole greedy rollout on device) against the model's rollout, the one torch reference.

fp32: tokens equal token for token (the kernels differ from torch only in fp32 summation order);
confidence within 1e-5 of the reference softmax. bf16: the reference rounds every op to bf16 while
the kernels keep fp32 inside, so a chain may part at a near-tie; the first divergence, if any, must
be one (reference margin <= 2 bf16 ulps of the top logit), as for real-model runs (docs/design.md §6).
Run: python -m pytest tests/kernels/test_head_rollout.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, model_rollout

from dominospec.kernels.head_rollout import head_rollout, head_weights

CASES = [  # V, H, G, r, K, P
    (203, 37, 19, 13, 7, 1),
    (131, 20, 11, 9, 5, 2),
    (77, 9, 5, 3, 1, 1),  # K = P: no corrected step
]


def make(V, H, G, r, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    w_ih = torch.randn(3 * G, H, generator=g) / H ** 0.5
    w_hh = torch.randn(3 * G, G, generator=g) / G ** 0.5
    w1 = torch.randn(r, H + G, generator=g) / (H + G) ** 0.5 * 2
    w2 = torch.randn(V, r, generator=g) / r ** 0.5 * 2  # a correction as large as the base: it changes tokens
    z = torch.randn(K, H, generator=g)
    base = torch.randn(K, V, generator=g)
    return [t.to(DEVICE, dtype) for t in (embed, w_ih, w_hh, w1, w2, z, base)]


def pool_of(base, P, M):
    return torch.topk(base[P:].max(0).values, M).indices if M else None


@pytest.mark.parametrize("use_table", [True, False])
@pytest.mark.parametrize("pool", [0, 11])
@pytest.mark.parametrize("V, H, G, r, K, P", CASES)
def test_fp32_chain_equals_reference(V, H, G, r, K, P, pool, use_table):
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=K)
    x_start = torch.tensor([3], device=DEVICE)
    ids = pool_of(base, P, pool) if K > P else None
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, table_budget_bytes=1 << 40 if use_table else 0)
    chain = head_rollout(weights, z, base, x_start, ids, confidence=True, block_v=32)
    tokens, scored = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, ids)
    assert chain.tokens.tolist() == tokens.tolist()
    expected = torch.stack([F.softmax(s, -1).max() for s in scored])
    torch.testing.assert_close(chain.confidence, expected, atol=1e-5, rtol=0)


def test_the_head_changes_the_chain():
    """The correction must matter in these tests, else equality would only check the base argmax."""
    embed, w_ih, w_hh, w1, w2, z, base = make(203, 37, 19, 13, 7, torch.float32, seed=7)
    weights = head_weights(embed, w_ih, w_hh, w1, w2, 1, 1 << 40)
    chain = head_rollout(weights, z, base, torch.tensor([3], device=DEVICE), block_v=32)
    assert chain.tokens.tolist() != base.argmax(-1).tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_chain_parts_only_at_near_ties(seed):
    V, H, G, r, K, P = 203, 37, 19, 13, 7, 1
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.bfloat16, seed=seed)
    x_start = torch.tensor([3], device=DEVICE)
    chain = head_rollout(head_weights(embed, w_ih, w_hh, w1, w2, P, 1 << 40), z, base, x_start, block_v=32)
    tokens, scored = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start)
    got, want = chain.tokens.tolist(), tokens.tolist()
    if got != want:
        j = next(i for i in range(K) if got[i] != want[i])
        top = float(scored[j].float().max())
        margin = top - float(scored[j][got[j]].float())
        assert margin <= 2 * 2 ** -7 * max(abs(top), 1.0), (j, margin)


@pytest.mark.parametrize("block_v, score_programs, block_g", [(16, 3, 4), (8, 1, 1), (64, 2, 32)])
@pytest.mark.parametrize("pool", [0, 37])
def test_launch_shapes_do_not_change_the_chain(block_v, score_programs, block_g, pool):
    """Programs that interleave several tiles each, GRU slices of any width: the same tokens and confidence."""
    V, H, G, r, K, P = 203, 37, 19, 13, 7, 1
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=11)
    x_start = torch.tensor([5], device=DEVICE)
    ids = pool_of(base, P, pool)
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, table_budget_bytes=1 << 40)
    chain = head_rollout(weights, z, base, x_start, ids, confidence=True, block_v=block_v,
                         score_programs=score_programs, block_g=block_g)
    tokens, scored = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, ids)
    assert chain.tokens.tolist() == tokens.tolist()
    expected = torch.stack([F.softmax(s, -1).max() for s in scored])
    torch.testing.assert_close(chain.confidence, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("columns", [(5, 40), (13, 24), (24, 13)])
def test_exact_ties_go_to_the_lowest_column(columns):
    """Tiles of 8 over 3 programs: column 13 sits in program 1, column 24 in program 0. The lowest
    column wins whichever program holds it (torch.argmax's rule), for a pure slot and a corrected one."""
    V, H, G, r, K, P = 48, 9, 5, 3, 2, 1
    embed, w_ih, w_hh, w1, _, z, _ = make(V, H, G, r, K, torch.float32)
    w2 = torch.zeros(V, r, device=DEVICE)  # no correction: the corrected row is the base row
    base = torch.zeros(K, V, device=DEVICE)
    base[:, list(columns)] = 3.0
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, 1 << 40)
    chain = head_rollout(weights, z, base, torch.tensor([1], device=DEVICE), block_v=8, score_programs=3)
    assert chain.tokens.tolist() == [min(columns)] * K


def test_pool_ties_go_to_the_first_pool_position():
    """In a pool the rule is torch's ids[argmax(scored)]: the first position, not the lowest id."""
    V, H, G, r, K, P = 48, 9, 5, 3, 2, 1
    embed, w_ih, w_hh, w1, _, z, _ = make(V, H, G, r, K, torch.float32)
    w2 = torch.zeros(V, r, device=DEVICE)
    base = torch.zeros(K, V, device=DEVICE)
    base[:, [7, 30]] = 3.0
    ids = torch.tensor([30, 2, 7, 11], device=DEVICE)
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, 1 << 40)
    chain = head_rollout(weights, z, base, torch.tensor([1], device=DEVICE), ids, block_v=2, score_programs=2)
    assert chain.tokens.tolist() == [7, 30]  # slot 0 is pure (full row: lowest id), slot 1 pooled (first position)


def sampled_reference(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, ids, noise, temperature):
    """The model's rollout drawing each step by the race on `noise` (engine.draft_head._Draws, the
    sampled chain's torch path) -> (tokens [K], q [K, V], q_j(d_j) [K])."""
    from common.random_head import head_model
    from dominospec.engine.draft_head import _Draws
    from dominospec.engine.sampling import Sampling

    model, table = head_model(embed, w_ih, w_hh, w1, w2, P, z.shape[0])
    draws = _Draws(Sampling(temperature=temperature), noise, base.shape[1], ids)
    out = model.rollout(z, base, x_start, table, sampler=draws, pool=ids, keep_logits=False)
    return out.tokens, torch.stack(draws.probs), torch.stack(draws.beliefs)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("pool", [0, 11])
@pytest.mark.parametrize("V, H, G, r, K, P", CASES)
def test_fp32_sampled_chain_equals_the_race_on_the_same_noise(V, H, G, r, K, P, pool, temperature):
    """Token for token the torch path's draws from the same uniforms (so the kernel draws from q_j
    exactly, as the race's chi-square test shows for the torch path), and the same q and q_j(d_j)."""
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=K + pool)
    x_start = torch.tensor([3], device=DEVICE)
    ids = pool_of(base, P, pool) if K > P else None
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, table_budget_bytes=1 << 40)
    g = torch.Generator(DEVICE).manual_seed(V + pool)
    for trial in range(4):
        noise = torch.rand(K, V, generator=g, device=DEVICE)
        chain = head_rollout(weights, z, base, x_start, ids, block_v=16, noise=noise, temperature=temperature)
        tokens, q, belief = sampled_reference(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, ids, noise, temperature)
        assert chain.tokens.tolist() == tokens.tolist(), trial
        torch.testing.assert_close(chain.probs, q, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(chain.confidence, belief, atol=1e-6, rtol=1e-5)
        if ids is not None:
            assert set(chain.tokens[P:].tolist()) <= set(ids.tolist()), "a pooled step draws inside the pool"


def test_sampled_chains_follow_the_noise():
    """Different uniforms give different chains (else the equality above could hold for a kernel
    that ignores the noise), and T -> 0 gives the greedy chain."""
    embed, w_ih, w_hh, w1, w2, z, base = make(203, 37, 19, 13, 7, torch.float32, seed=5)
    weights = head_weights(embed, w_ih, w_hh, w1, w2, 1, 1 << 40)
    x_start = torch.tensor([3], device=DEVICE)
    g = torch.Generator(DEVICE).manual_seed(0)
    chains = {tuple(head_rollout(weights, z, base, x_start, noise=torch.rand(7, 203, generator=g, device=DEVICE),
                                 temperature=1.0).tokens.tolist()) for _ in range(6)}
    assert len(chains) > 1
    cold = head_rollout(weights, z, base, x_start, noise=torch.rand(7, 203, generator=g, device=DEVICE), temperature=1e-4)
    assert cold.tokens.tolist() == head_rollout(weights, z, base, x_start).tokens.tolist()
