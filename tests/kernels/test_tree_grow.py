"""kernels.tree_grow (DominoTree's build, three launches a depth) against engine.domino_tree.grow_tree,
the torch reference, on the same raw head weights (bench.head_model).

- fp32: the same tree, node for node (paths, scores to fp32 summation order, best-first order, parent
  rows, depths and the ancestor bitmask), over budgets from one node to more than a frontier holds,
  pure draft slots (P = 1, 2), a pool smaller than the children offered, K = P, and several row
  tiles, score blocks and pure-slot blocks (the default blocks and narrower and wider ones);
- each frontier is the best of its offers: a broken select (an unsorted kept set) fails the test;
- the engine's build on the kernels (TreeGrower), its candidate pool from kernels.pool_select, the
  same tree as the reference's, and that pool the reference pool;
- bf16: every node's score is its path's exact one, and the tree may part from the reference only
  where the exact scores tie within bf16 rounding (a swap, or the budget's edge).
Run: python -m pytest tests/kernels/test_tree_grow.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE
from test_head_rollout import make

from common.random_head import head_model
from dominospec.engine.domino_tree import best_nodes, grow_tree
from dominospec.kernels.head_rollout import head_weights
from dominospec.kernels.pool_select import pool_select_reference
from dominospec.engine.domino_tree import ancestor_bits
from dominospec.kernels.tree_grow import ancestor_bits as ancestor_bits_kernel
from dominospec.kernels.tree_grow import frontier_sizes, offered, score_split, tree_levels, tree_weights

CASES = [  # V, H, G, r, K, P, nodes, children, pool
    (203, 37, 19, 13, 7, 1, 24, 4, 40),
    (131, 20, 11, 9, 5, 2, 9, 3, 17),
    (96, 16, 8, 4, 4, 1, 1, 4, 32),
    (96, 16, 8, 4, 4, 1, 200, 4, 32),  # more nodes than the tree reaches at depth 1..3
    (77, 9, 5, 3, 2, 2, 6, 3, 8),  # K = P: no corrected slot
    (64, 12, 8, 6, 3, 1, 10, 5, 3),  # a pool of 3 offers 3 children, not 5
    (2100, 12, 6, 5, 3, 1, 20, 3, 150),  # 3 pure-slot blocks of 1,024 columns, 3 score blocks, 2 row tiles
]


def paths(tree) -> dict:
    """{path of tokens from x_start: (row, score)}."""
    rows, out = [()], {}
    for i, (t, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        rows.append(rows[p] + (t,))
        out[rows[-1]] = (i, float(tree.scores[i]))
    return out


def build(V, H, G, r, K, P, nodes, children, pool, dtype, seed=0, score_cols=None):
    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, dtype, seed=seed)
    x_start = torch.tensor([5], device=DEVICE)
    model, embed_tokens = head_model(embed, w_ih, w_hh, w1, w2, P, K)
    weights = tree_weights(head_weights(embed, w_ih, w_hh, w1, w2, P, table_budget_bytes=1 << 40))
    ids = pool_select_reference(base, P, pool)
    with torch.inference_mode():
        want = grow_tree(model, z, base, x_start, embed_tokens, nodes, children, pool)
        levels = tree_levels(weights, z, base, x_start, ids, nodes, children, score_cols)
        got = best_nodes(levels.tokens, levels.scores, levels.depth, levels.parent, nodes, K, ancestor_bits_kernel)
    return got, want, levels


@pytest.mark.parametrize("V, H, G, r, K, P, nodes, children, pool", CASES)
def test_fp32_tree_equals_reference(V, H, G, r, K, P, nodes, children, pool):
    got, want, levels = build(V, H, G, r, K, P, nodes, children, pool, torch.float32, seed=K + nodes)
    assert levels.tokens.shape[0] == sum(frontier_sizes(nodes, offered(K, P, children, V, pool)))
    assert_same_tree(got, want)


def assert_same_tree(got, want) -> None:
    """fp32: node for node, best first in the reference's order, scores to fp32 summation order."""
    assert got.size == want.size
    ours, theirs = paths(got), paths(want)
    assert ours.keys() == theirs.keys()
    for path, (row, score) in theirs.items():
        assert ours[path][0] == row, "best first, in the reference's order"
        assert ours[path][1] == pytest.approx(score, abs=1e-4)
    assert torch.equal(got.parents, want.parents) and torch.equal(got.depth, want.depth)
    assert torch.equal(got.bits, want.bits)


@pytest.mark.parametrize("V, H, G, r, K, P, nodes, children, pool", [CASES[0], CASES[1], CASES[5], CASES[6]])
def test_the_engine_s_kernel_build_takes_its_pool_from_the_pool_kernel(V, H, G, r, K, P, nodes, children, pool):
    """The engine's build on the kernels (TreeGrower, head_kernel triton): the candidate pool from
    kernels.pool_select, which must equal its torch reference at the tree's shapes, then the tree
    node for node the torch reference's (grow_tree, whose pool is candidate_pool's)."""
    from dominospec.engine.domino_tree import TreeGrower
    from dominospec.kernels.pool_select import pool_select

    embed, w_ih, w_hh, w1, w2, z, base = make(V, H, G, r, K, torch.float32, seed=K + nodes + 1)
    model, embed_tokens = head_model(embed, w_ih, w_hh, w1, w2, P, K)
    x_start = torch.tensor([5], device=DEVICE)
    grower = TreeGrower(model, embed_tokens, nodes, children, pool, kernels=True)  # no graph holder: eager
    assert grower.kernels is not None and grower.pool is not None, "the build runs on the kernels, pool included"
    assert torch.equal(pool_select(base, P, pool, grower.pool).cpu(), pool_select_reference(base, P, pool).cpu())
    with torch.inference_mode():
        got = grower.grow(z, base, x_start)
        want = grow_tree(model, z, base, x_start, embed_tokens, nodes, children, pool)
    assert_same_tree(got, want)


@pytest.mark.parametrize("score_cols", [16, 128])
def test_fp32_tree_equals_reference_at_other_score_blocks(score_cols):
    """Narrow blocks: many partials a row for the select; wide: one block holds the whole pool."""
    got, want, _ = build(203, 37, 19, 13, 7, 1, 24, 4, 100, torch.float32, seed=3, score_cols=score_cols)
    ours, theirs = paths(got), paths(want)
    assert ours.keys() == theirs.keys()
    assert all(ours[path][0] == row for path, (row, _) in theirs.items())


def test_score_blocks_widen_for_wide_frontiers():
    assert score_split(2048, 16, 4) == (64, 32)  # SCORE_COLS
    assert score_split(2048, 256, 4) == (128, 16)  # 256 rows x 16 blocks x 4 = SELECT_PARTIALS
    assert score_split(2048, 16, 4, cols=16) == (16, 128)
    assert score_split(40, 1, 4) == (64, 1)


def test_each_frontier_is_sorted_best_first():
    _, _, levels = build(203, 37, 19, 13, 7, 1, 24, 4, 40, torch.float32, seed=1)
    scores, depth = levels.scores.tolist(), levels.depth.tolist()
    for d in set(depth):
        level = [s for s, dd in zip(scores, depth) if dd == d]
        assert level == sorted(level, reverse=True), d
    assert len(set(levels.tokens.tolist())) > 4, "the children differ"


def exact_scores(V, H, G, r, K, P, pool, dtype, seed, path_list) -> dict:
    """Each path's log-probability under the same (dtype-rounded) weights and inputs, in fp64: slot j's
    log-softmax over the whole vocabulary (j < P) or over the reference's pool of the corrected logits,
    the GRU having read x_start and the path before j -> {path: score}."""
    from dominospec.engine.draft_head import pooled_head

    weights = [t.double() for t in make(V, H, G, r, K, dtype, seed=seed)]
    model, embed = head_model(*weights[:5], P, K)
    z, base = weights[5], weights[6]
    cand = pool_select_reference(make(V, H, G, r, K, dtype, seed=seed)[6], P, pool)
    w2, scored = pooled_head(model, base, cand)
    out = {}
    with torch.inference_mode():
        for path in path_list:
            state, score = model.gru_step(embed(torch.tensor([5], device=DEVICE)), z.new_zeros(1, G)), 0.0
            for j, token in enumerate(path):
                if j < P:
                    score += float(torch.log_softmax(base[j], -1)[token])
                else:
                    logq = torch.log_softmax(scored[j] + torch.nn.functional.linear(model.correction_hidden(z[j][None], state), w2), -1)
                    score += float(logq[0, int((cand == token).nonzero()[0, 0])])
                state = model.gru_step(embed(torch.tensor([token], device=DEVICE)), state)
            out[path] = score
    return out


@pytest.mark.parametrize("seed", [2, 5])  # 5: the trees part at a tie of the first slot
def test_bf16_tree_parts_only_at_near_ties(seed):
    """Every node the kernels' tree holds has its exact score; where it parts from the reference's
    (a node one holds and the other not, under a parent both hold), the exact scores tie within bf16
    rounding: the node swapped for one as good, or at the edge of the other tree's budget."""
    V, H, G, r, K, P, nodes, children, pool = 203, 37, 19, 13, 7, 1, 24, 4, 40
    got, want, _ = build(V, H, G, r, K, P, nodes, children, pool, torch.bfloat16, seed=seed)
    ours, theirs = paths(got), paths(want)
    exact = exact_scores(V, H, G, r, K, P, pool, torch.bfloat16, seed, list(ours.keys() | theirs.keys()))
    # bf16 logits carry ~3 significant digits: a path's log-probability may be off by a few bf16 ulps
    # of its logits (|u| < 5 here) per step
    tol = lambda path: 0.05 * len(path)  # noqa: E731
    for path, (_, score) in ours.items():
        assert score == pytest.approx(exact[path], abs=tol(path)), path
    only_ours = [p for p in ours if p not in theirs and (len(p) == 1 or p[:-1] in theirs)]
    only_theirs = [p for p in theirs if p not in ours and (len(p) == 1 or p[:-1] in ours)]
    assert len(ours.keys() & theirs.keys()) >= nodes // 2, "most of the tree is the reference's"
    for mine, other, other_tree in ((only_ours, only_theirs, theirs), (only_theirs, only_ours, ours)):
        edge = min(exact[p] for p in other_tree)  # the other tree's worst node: its budget's cut
        for path in mine:
            tied = any(abs(exact[path] - exact[o]) <= tol(path) for o in other)
            assert tied or abs(exact[path] - edge) <= tol(path), (path, exact[path], edge)


@pytest.mark.parametrize("T, steps", [(1, 1), (9, 3), (64, 7), (65, 7), (200, 15), (257, 15)])
def test_one_launch_ancestor_bits_equal_the_torch_passes(T, steps):
    """Random trees (a parent before its child, depth <= steps) over one to five mask words."""
    g = torch.Generator().manual_seed(T)
    parents, depth = [0], [0]
    for row in range(1, T):
        choices = [p for p in range(row) if depth[p] < steps]
        parents.append(choices[int(torch.randint(len(choices), (1,), generator=g))])
        depth.append(depth[parents[-1]] + 1)
    parents = torch.tensor(parents, device=DEVICE)
    assert torch.equal(ancestor_bits_kernel(parents, steps), ancestor_bits(parents, steps))
