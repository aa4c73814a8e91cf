"""DominoTree at every budget, verified on the lean runner's shapes.

A tree of n nodes (1 <= n <= 256) beside a prompt lookup of up to 7 tokens is a verify of up to
264 rows. The grower writes each row's ancestors as a bitmask of several int64 words; the lean
runner pads the rows up to its bucket and replays that bucket's forward. Checked here:
- every budget's bitmask (the grower's, cut to n, plus the lookup rows) is the brute-force ancestor
  relation of its parent rows;
- every budget's lean forward (reference ops) gives the logits and features of the same tree on
  transformers' forward with a dense mask, in fp64;
- on buckets of one to five mask words, padded and not, the forward on the Triton kernels
  (interpreted on the CPU) equals it on their references.
Run: python -m pytest tests/kernels/test_tree_budgets.py -q
"""

import os

import pytest
import torch
from engine_helpers import tiny_draft, tiny_target

from dominospec.engine.domino_tree import grow_tree
from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.engine.target_kv import DynamicTargetKV, LeanForward, StaticTargetKV, row_buckets
from dominospec.engine.verify_shape import words_for

NODES, LOOKUP = 256, 7
MAX_ROWS = 1 + NODES + LOOKUP
PROMPT = 9


def brute_force_visible(parents: list[int]) -> torch.Tensor:
    """Parent row per row (row 0 its own) -> [T, T] bool: a row sees itself and its ancestors."""
    T = len(parents)
    visible = torch.eye(T, dtype=torch.bool)
    for row in range(1, T):
        up = row
        while up:
            up = parents[up]
            visible[row, up] = True
    return visible


def unpack(bits: torch.Tensor) -> torch.Tensor:
    T = bits.shape[0]
    return ((bits[:, :, None] >> torch.arange(64)) & 1).reshape(T, -1)[:, :T].bool()


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3", vocab=40, dtype=torch.float64, layers=2, head_dim=16)
    draft = tiny_draft(target, block_size=8, seed=3)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 39, (1, PROMPT), generator=g)
    lookup = torch.randint(3, 39, (LOOKUP,), generator=g)
    with torch.inference_mode():
        z = torch.randn(7, int(draft.config.hidden_size), generator=g, dtype=torch.float64)
        u = draft.lm_head(z) if hasattr(draft, "lm_head") else target.lm_head(z)
        tree = grow_tree(draft, z, u, prompt[0, -1:], target.embed_tokens, NODES, 4, 0)
    assert tree.size == NODES and tree.bits.shape == (1 + NODES, words_for(1 + NODES))
    return target, tree, prompt, lookup


def verify_ids(tree, n, L, prompt, lookup):
    return torch.cat([prompt[0, -1:], tree.tokens[:n], lookup[:L]])[None]


def expected_parents(tree, n: int, L: int) -> list[int]:
    """The verify's layout, written out: x_start, the tree's best n nodes under their own parents,
    then the lookup chain under x_start (its first token's parent row 0, each next one the row before)."""
    return [0] + tree.parents[:n].tolist() + [0 if k == 1 else n + k - 1 for k in range(1, L + 1)]


def depths(parents: list[int]) -> list[int]:
    out = [0] * len(parents)
    for row in range(1, len(parents)):
        out[row] = out[parents[row]] + 1
    return out


def test_every_budget_s_bitmask_is_its_ancestor_relation(setup):
    _, tree, _, _ = setup
    for n in range(0, NODES + 1):
        for L in (0, LOOKUP) if n % 5 else (0, 1, 3, LOOKUP):
            shape, parents = tree.verify_rows(n, L)
            T = 1 + n + L
            assert shape.bits.shape == (T, words_for(T)) and shape.depth.shape == parents.shape == (T,)
            layout = expected_parents(tree, n, L)  # from the tree and the lookup's length, not from verify_rows
            assert parents.tolist() == layout and shape.depth.tolist() == depths(layout), (n, L)
            visible = brute_force_visible(layout)
            assert torch.equal(unpack(shape.bits), visible), (n, L)
            assert torch.equal(shape.mask(), visible), (n, L)


def test_every_budget_verifies_on_the_lean_runner_as_on_transformers(setup):
    target, tree, prompt, lookup = setup
    lean = StaticTargetKV(LeanForward(LeanDecoder(target.model, DecoderOps.reference())), [0],
                          capacity=PROMPT + MAX_ROWS + 1, max_rows=MAX_ROWS, graphs=False)
    dense = DynamicTargetKV(target.model, [0])
    with torch.inference_mode():
        for runner in (lean, dense):
            runner.forward(prompt[:, :-1], keep=1)
        for n in range(1, NODES + 1):
            L = LOOKUP if n % 2 else 0
            shape, _ = tree.verify_rows(n, L)
            ids = verify_ids(tree, n, L, prompt, lookup)
            (a, fa), (b, fb) = (runner.forward(ids, keep=ids.shape[1], tree=shape) for runner in (dense, lean))
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(fb, fa, rtol=1e-9, atol=1e-9)
            for runner in (lean, dense):
                runner.crop(PROMPT - 1)
    assert lean.buckets == row_buckets(MAX_ROWS) and lean.buckets[-1] == MAX_ROWS and len(lean.buckets) < 40


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the Triton ops need CUDA or TRITON_INTERPRET=1 (tests/kernels sets it)")
def test_buckets_of_every_word_count_on_the_triton_ops_equal_them_on_the_references(setup):
    target, tree, prompt, lookup = setup
    target = tiny_target("qwen3", vocab=40, dtype=torch.float32, layers=1, head_dim=16)
    runners = [StaticTargetKV(LeanForward(LeanDecoder(target.model, ops)), [0], capacity=PROMPT + MAX_ROWS + 1,
                              max_rows=MAX_ROWS, graphs=False) for ops in (DecoderOps.reference(), DecoderOps.triton())]
    with torch.inference_mode():
        for runner in runners:
            runner.forward(prompt[:, :-1], keep=1)
        for rows in (17, 64, 65, 130, MAX_ROWS):  # padded to 24; one word whole; 2 words padded to 80; 3; 5
            assert (rows in row_buckets(MAX_ROWS)) == (rows in (64, MAX_ROWS))
            n = min(rows - 1, NODES)
            L = rows - 1 - n
            shape, _ = tree.verify_rows(n, L)
            ids = verify_ids(tree, n, L, prompt, lookup)
            (a, fa), (b, fb) = (runner.forward(ids, keep=rows, tree=shape) for runner in runners)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fb, fa, rtol=1e-5, atol=1e-5)
            for runner in runners:
                runner.crop(PROMPT - 1)
