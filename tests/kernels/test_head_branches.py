"""kernels.head_branches (a draft tree's W branches on device) against the model's rollout with `first`, the one torch reference.

- fp32: tokens equal token for token over odd shapes, with and without the GRU table and a pool,
  with pure draft slots (P = 2) and without a corrected step (K = P);
- the reference's branch w equals the model's chain rollout run alone from first[w] (so the W-row
  batching is not hiding a mixed-up row), and W = 1 is `head_rollout`'s chain;
- the head changes tokens in these cases, and different first tokens lead to different branches;
- bf16: a branch may part from the reference only at a near-tie (<= 2 bf16 ulps of the top logit).
Run: python -m pytest tests/kernels/test_head_branches.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEVICE, model_rollout
from test_head_rollout import make, pool_of

from dominospec.kernels.head_branches import head_branches
from dominospec.kernels.head_rollout import head_rollout, head_weights

CASES = [  # V, H, G, r, K, P, W
    (203, 37, 19, 13, 7, 1, 4),
    (131, 20, 11, 9, 5, 2, 3),
    (77, 9, 5, 3, 1, 1, 2),  # K = P: the first tokens alone
    (96, 16, 8, 4, 4, 1, 5),
]


def first_of(base, W):
    """The W most likely tokens of u_0, best first (engine.head_kernels.first_tokens' rule)."""
    return torch.topk(base[0].float(), W).indices


@pytest.mark.parametrize("use_table", [True, False])
@pytest.mark.parametrize("pool", [0, 11])
@pytest.mark.parametrize("V, H, G, r, K, P, W", CASES)
def test_fp32_branches_equal_reference(V, H, G, r, K, P, W, pool, use_table):
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=K + W)
    x_start = torch.tensor([3], device=DEVICE)
    ids = pool_of(base, P, pool) if K > P else None
    first = first_of(base, W)
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, table_budget_bytes=1 << 40 if use_table else 0)
    got = head_branches(weights, z, base, x_start, first, ids)
    want = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, ids, first=first)[0]
    assert got.shape == (W, K)
    assert got.tolist() == want.tolist()


def test_reference_branch_is_a_chain_from_its_first_token():
    """Branch w = the single-row rollout whose slot 0 is forced to first[w]: the chain reference with
    u_0 replaced by a one-hot at first[w] (slot 0 is pure, so only its argmax matters)."""
    V, H, G, r, K, P, W = 203, 37, 19, 13, 7, 1, 4
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=3)
    x_start = torch.tensor([3], device=DEVICE)
    first = first_of(base, W)
    tree = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, first=first)[0]
    for w in range(W):
        forced = base.clone()
        forced[0] = -1e9
        forced[0, first[w]] = 0.0
        chain, _ = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, forced, x_start)
        assert tree[w].tolist() == chain.tolist(), w
    assert len({tuple(row) for row in tree[:, 1:].tolist()}) > 1, "every branch went on alike: the head saw no prefix"


@pytest.mark.parametrize("pool", [0, 11])
def test_one_branch_is_the_chain(pool):
    V, H, G, r, K, P = 203, 37, 19, 13, 7, 1
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=5)
    x_start = torch.tensor([4], device=DEVICE)
    ids = pool_of(base, P, pool)
    weights = head_weights(embed, w_ih, w_hh, w1, w2, P, 1 << 40)
    chain = head_rollout(weights, z, base, x_start, ids)
    got = head_branches(weights, z, base, x_start, first_of(base, 1), ids)
    assert got.tolist() == [chain.tokens.tolist()]
    assert chain.tokens.tolist() != base.argmax(-1).tolist(), "the head never changed a token"


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_branches_part_only_at_near_ties(seed):
    V, H, G, r, K, P, W = 203, 37, 19, 13, 7, 1, 4
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.bfloat16, seed=seed)
    x_start = torch.tensor([3], device=DEVICE)
    first = first_of(base, W)
    got = head_branches(head_weights(embed, w_ih, w_hh, w1, w2, P, 1 << 40), z, base, x_start, first).tolist()
    want = model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, first=first)[0].tolist()
    for w in range(W):
        if got[w] == want[w]:
            continue
        j = next(i for i in range(K) if got[w][i] != want[w][i])
        # the reference's scored row at slot j of branch w, rebuilt from its own prefix
        state = torch.gru_cell(embed[x_start], w_hh.new_zeros(1, G), w_ih, w_hh)
        for token in want[w][:j]:
            state = torch.gru_cell(embed[torch.tensor([token], device=DEVICE)], state, w_ih, w_hh)
        scored = base[j] + F.linear(F.silu(F.linear(torch.cat([z[j], state[0]]), w1)), w2)
        top = float(scored.float().max())
        margin = top - float(scored[got[w][j]].float())
        assert margin <= 2 * 2 ** -7 * max(abs(top), 1.0), (w, j, margin)
