"""Draft trees (engine.draft_head, engine.tree shape first_token, `width` W): the draft's W best first tokens, each drafted on.

- `DraftHead.branches` at W = 1 is `DraftHead.chain`'s greedy chain (head on, with and without the pool;
  head off).
- At W = 4 each branch equals a reference written out one branch at a time with the model's own ops:
  branch w starts with the w-th most likely token of u_0, then the head's argmax of u_j + delta_j over
  its own GRU state (the pool's tokens only, with a pool); head off, every branch goes on with argmax u_j.
- Greedy decoding with a first-token tree of width 3 equals AR token for token (domino, dflash; fixed K and auto-K;
  dynamic and static caches; with and without a lookup branch), with rounds won by a guess other than
  the draft's best; the draft context stays in step with the target KV.
- Under sampling no round branches; width 0 is refused, naming the key.
Run: python -m pytest tests/engine/test_branches.py -q
"""

import dataclasses

import pytest
import torch
from engine_helpers import engine_params, repetitive_prompts, stats_equal_to_ar, streaming_cost, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.engine.draft_head import DraftHead, candidate_pool
from dominospec.engine.sampling import Sampling
from dominospec.errors import UserError


def block(target, K: int, seed: int):
    """A random block: z [K, H], base logits [K, V], x_start [1], in the target's dtype."""
    g = torch.Generator().manual_seed(seed)
    H, V = target.hidden_size, target.embed_tokens.weight.shape[0]
    dtype = target.embed_tokens.weight.dtype
    z = torch.randn(K, H, generator=g, dtype=dtype)
    return z, 3 * torch.randn(K, V, generator=g, dtype=dtype), torch.randint(3, V - 1, (1,), generator=g)


@pytest.mark.parametrize("head, pool", [(True, 0), (True, 24), (False, 0)])
def test_one_branch_is_the_greedy_chain(head, pool):
    target = tiny_target("llama", vocab=96, dtype=torch.float64)
    draft = tiny_draft(target, block_size=6, head=True, scale=1.0)
    for seed in range(8):
        z, u, x = block(target, 5, seed)
        drafts = DraftHead(draft, target.embed_tokens, head, pool)
        chain = drafts.chain(z, u, x, Sampling(), None, confidence=False)
        got = drafts.branches(z, u, x, 1)
        assert got.tolist() == [chain.tokens.tolist()]


def reference_branch(draft, embed_tokens, z, u, x, first, head, cand):
    """One branch, token by token, with the model's own ops over the full vocabulary (or `cand`)."""
    tokens, K = [int(first)], u.shape[0]
    state = draft.gru_step(embed_tokens(x), z.new_zeros(1, draft.config.gru_hidden_dim))
    state = draft.gru_step(embed_tokens(torch.tensor([tokens[0]])), state)
    for j in range(1, K):
        logits = u[j] + draft.correction(z[j][None], state)[0] if head else u[j]
        if cand is not None:
            logits = torch.full_like(logits, float("-inf")).index_copy(0, cand, logits[cand])
        tokens.append(int(logits.argmax()))
        state = draft.gru_step(embed_tokens(torch.tensor([tokens[-1]])), state)
    return tokens


@pytest.mark.parametrize("head, pool", [(True, 0), (True, 24), (False, 0)])
def test_each_branch_equals_its_reference(head, pool):
    target = tiny_target("llama", vocab=96, dtype=torch.float64)
    draft = tiny_draft(target, block_size=6, head=True, scale=1.0)
    side_changes = 0
    for seed in range(8):
        z, u, x = block(target, 5, seed)
        got = DraftHead(draft, target.embed_tokens, head, pool).branches(z, u, x, 4)
        order = u[0].argsort(descending=True)[:4]
        cand = candidate_pool(u, int(draft.config.pure_draft_prefix_len), pool)
        assert got[:, 0].tolist() == order.tolist()
        for w in range(4):
            assert got[w].tolist() == reference_branch(draft, target.embed_tokens, z, u, x, order[w], head, cand)
        side_changes += int((got[1:, 1:] != got[0, 1:]).any())
    # with the head the branches go on differently (each from its own first token); without, alike
    assert side_changes > 0 if head else side_changes == 0


TREE = engine_params(tree=dict(shape="first_token", width=3))
TREE_FORK = engine_params(tree=dict(shape="first_token", width=3), ngram_assist=True, ngram_fork=True, ngram_max=3)


@pytest.mark.parametrize("mode", ["domino", "dflash"])
@pytest.mark.parametrize("num_draft", [None, "auto"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("options", [TREE, TREE_FORK], ids=["tree", "tree+lookup"])
def test_greedy_tree_equals_ar(mode, num_draft, static, options):
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    if static:
        options = dataclasses.replace(options, cuda_graphs="static", graph_capacity=128)
    engine = SpecEngine(target, draft, mode, num_draft, options)
    assert engine.max_verify == 3 * 3 + (7 if options.ngram_fork else 0)
    engine.cost = streaming_cost(engine.max_verify)  # auto-K: a fixed cost table, not this machine's timing
    stats = stats_equal_to_ar(engine, ar)
    trees, side_wins = sum(s.tree_rounds for s in stats), sum(s.tree_side_wins for s in stats)
    assert trees > 20 and side_wins > 5, (trees, side_wins)
    if options.ngram_fork:
        assert sum(s.fork_lookup_wins for s in stats) > 0  # the lookup branch wins too


def test_sampling_never_branches_and_width_0_is_refused():
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    engine = SpecEngine(target, draft, "domino", None, TREE_FORK)
    drafted = 0
    for i, prompt in enumerate(repetitive_prompts(6, 8, seed=3)):
        out = engine.generate(prompt, 24, Sampling(temperature=1.0), seed=i)
        assert out.stats.tree_rounds == out.stats.fork_rounds == 0
        drafted += out.stats.draft_rounds
    assert drafted > 0
    with pytest.raises(UserError, match="engine.tree.width must be >= 1"):
        SpecEngine(target, draft, "domino", None, engine_params(tree=dict(shape="first_token", width=0)))
