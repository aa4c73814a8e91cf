"""Forking rounds (engine.proposers, engine.verify_shape): proposals verified as branches of one forward.

- `branch_tree` equals a mask written out by hand from the rule: a row sees row 0 and its own
  branch's earlier rows; one branch is the chain.
- On both target runners (dynamic cache, and the static one the CUDA graphs replay), a forward of
  three branches gives each branch the logits and features of verifying that branch alone (fp64);
  after `select` + crop to a branch other than the first, the next forward equals the one after
  verifying that branch alone: the KV rows moved into place are the right ones.
- `accept_branches` keeps the branch that accepts most; a tie keeps the earlier branch.
- `choose_fork`: with a lookup that is never accepted it chooses the chain alone, as `choose_k`; a
  grid search written out with the estimate of engine.policy agrees on random survivals and costs;
  with a draft that is never accepted it verifies the lookup alone.
- Greedy decoding with ngram_fork equals AR token for token (domino, dflash; fixed K and auto-K;
  dynamic and static caches), with fork rounds won by each branch; the draft context stays in
  step with the target KV. Under sampling no round forks.
Run: python -m pytest tests/engine/test_fork.py -q
"""

import dataclasses
import random

import pytest
import torch
from engine_helpers import engine_params, repetitive_prompts, stats_equal_to_ar, streaming_cost, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.engine.accept import accept_greedy
from dominospec.engine.proposal import Verdict, chains
from dominospec.engine.policy import RoundCost, choose_fork, choose_k
from dominospec.engine.sampling import Sampling
from dominospec.engine.target_kv import DynamicTargetKV, HFForward, StaticTargetKV
from dominospec.engine.verify_shape import branch_tree, chain_tree

FORK = engine_params(ngram_assist=True, ngram_fork=True, ngram_max=3)  # a chain (engine.tree.shape): chain + lookup
CPU = torch.device("cpu")


def test_branch_tree_is_the_mask_of_its_rule():
    lengths = [2, 1, 3]
    branch = [0, 1, 1, 2, 3, 3, 3]
    expected = [[j == 0 or (branch[i] == branch[j] and j <= i) for j in range(7)] for i in range(7)]
    tree = branch_tree(lengths, CPU)
    assert tree.visible.tolist() == expected
    assert tree.depth.tolist() == [0, 1, 2, 1, 1, 2, 3]
    assert branch_tree([3], CPU).visible.tolist() == chain_tree(4, CPU).visible.tolist()
    assert branch_tree([3], CPU).depth.tolist() == chain_tree(4, CPU).depth.tolist()


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_branch_forward_equals_each_branch_alone(runner):
    target = tiny_target("llama", vocab=32, dtype=torch.float64)
    layers = [0, target.num_layers - 2]

    def make():
        if runner == "dynamic":
            return DynamicTargetKV(target.model, layers)
        return StaticTargetKV(HFForward(target.model), layers, capacity=64, max_rows=12, graphs=False)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 31, (1, 9), generator=g)
    x = torch.tensor([[7]])
    branches = [torch.randint(3, 31, (1, n), generator=g) for n in (3, 3, 4)]  # two draft branches, a lookup
    after = torch.randint(3, 31, (1, 2), generator=g)
    with torch.inference_mode():
        alone, next_alone = [], {}
        for b, branch in enumerate(branches):
            kv = make()
            kv.forward(prompt, keep=1)
            alone.append(kv.forward(torch.cat([x, branch], 1), keep=1 + branch.shape[1]))
            kv.crop(9 + 3)  # keep x and the branch's first 2 tokens, then one more forward
            next_alone[b] = kv.forward(after, keep=2)
        rows = [[0, 1, 2, 3], [0, 4, 5, 6], [0, 7, 8, 9, 10]]
        for b in (1, 2):  # the winner moved into place: a middle branch, and the last
            kv = make()
            kv.forward(prompt, keep=1)
            logits, features = kv.forward(torch.cat([x, *branches], 1), keep=11, tree=branch_tree([3, 3, 4], CPU))
            for own, (want_logits, want_features) in zip(rows, alone):
                torch.testing.assert_close(logits[:, own], want_logits, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(features[:, own], want_features, rtol=1e-10, atol=1e-10)
            kv.select(rows[b][:3])
            kv.crop(9 + 3)
            got = kv.forward(after, keep=2)
            torch.testing.assert_close(got[0], next_alone[b][0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(got[1], next_alone[b][1], rtol=1e-10, atol=1e-10)


def one_hot_logits(rows: list[int], V: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), V).double()


def branches_verdict(branches, logits):
    """Chains under row 0 (drafts first, the last a lookup when `lookup`), verify logits in branch_tree's
    row order -> (the verdict, per-branch acceptance, the winner's index)."""
    x_start = torch.tensor([0])
    proposal = chains([("draft", b) for b in branches], x_start)
    ids = torch.cat([x_start, proposal.tokens])
    verdict = Verdict(accept_greedy(ids, proposal.parents, logits), None, proposal)
    per_branch = [len(verdict.path_in(part)) for part in proposal.parts]
    return verdict, per_branch, proposal.parts.index(verdict.winner())


def test_greedy_acceptance_on_branches_keeps_the_longest_and_the_earlier_on_a_tie():
    chain, lookup = torch.tensor([4, 5, 6]), torch.tensor([4, 8, 9])
    # target's greedy tokens by row: row 0 -> 4; chain rows (4, 5, 6) -> 5, 1, _; lookup rows (4, 8, 9) -> 8, 9, 3
    v, per_branch, winner = branches_verdict([chain, lookup], one_hot_logits([4, 5, 1, 0, 8, 9, 3]))
    assert (per_branch, winner, v.tokens, v.rows) == ([2, 3], 1, [4, 8, 9, 3], [0, 4, 5, 6])
    v, _, winner = branches_verdict([chain, lookup], one_hot_logits([4, 5, 6, 7, 0, 0, 0]))
    assert (v.tokens, v.rows, winner) == ([4, 5, 6, 7], [0, 1, 2, 3], 0)
    v, _, winner = branches_verdict([chain, lookup], one_hot_logits([4, 0, 0, 0, 0, 0, 0]))  # a tie at 1: the chain
    assert (v.tokens, winner, v.rows) == ([4, 0], 0, [0, 1])
    # three draft branches (first guesses 4, 2, 6), the second right for two tokens, then a plain miss
    branches = [torch.tensor([4, 5]), torch.tensor([2, 7]), torch.tensor([6, 1])]
    v, per_branch, winner = branches_verdict(branches, one_hot_logits([2, 0, 0, 7, 9, 0, 0]))
    assert (per_branch, winner, v.tokens, v.rows) == ([0, 2, 0], 1, [2, 7, 9], [0, 3, 4])
    v, per_branch, winner = branches_verdict(branches, one_hot_logits([3, 0, 0, 0, 0, 0, 0]))  # none: the target's own
    assert (per_branch, winner, v.tokens, v.rows) == ([0, 0, 0], 0, [3], [0])


def _rate(cost, chain, lookup, kd, kl):
    """Expected tokens per ms of a forking round, written out: the chain accepts >= k with a_k, the
    lookup with l_k, and P(either accepts >= k) = 1 - (1 - a_k)(1 - l_k)."""
    a = chain[:kd] + [0.0] * 8
    l = lookup[:kl] + [0.0] * 8  # noqa: E741
    ms = (cost.draft + kd * cost.rollout_step if kd else 0) + cost.verify[kd + kl]
    return (1 + sum(1 - (1 - a[k]) * (1 - l[k]) for k in range(8))) / ms


def reference_fork_choice(cost, chain, lookup, kd_max, kl_max):
    """Brute force over the grid (`_rate`), a plain step included."""
    rates = {(kd, kl): _rate(cost, chain, lookup, kd, kl) for kd in range(kd_max + 1) for kl in range(kl_max + 1)}
    return max(rates, key=rates.get)


def test_choose_fork_against_brute_force_and_choose_k():
    rng = random.Random(0)
    drafts_alone = lookups_alone = forks = 0
    for trial in range(300):
        verify = sorted(rng.uniform(10, 16) for _ in range(3 + 7 + 1))
        cost = RoundCost(verify=verify, draft=rng.uniform(0, 4), rollout_step=rng.uniform(0, 0.5))
        chain = sorted((rng.uniform(0.05, 1) for _ in range(3)), reverse=True)
        lookup = sorted((rng.random() for _ in range(7)), reverse=True)
        kl_max = rng.randrange(0, 8)
        got = choose_fork(cost, chain, lookup, 3, kl_max)
        want = reference_fork_choice(cost, chain, lookup, 3, kl_max)
        rate = lambda shape: _rate(cost, chain, lookup, *shape)  # noqa: E731
        assert got == want or abs(rate(got) - rate(want)) < 1e-12, (got, want)
        drafts_alone += got[0] > 0 == got[1]
        lookups_alone += got[1] > 0 == got[0]
        forks += got[0] > 0 and got[1] > 0
        assert choose_fork(cost, chain, [0.0] * 7, 3, kl_max) == (choose_k(cost, chain, 3), 0)
        assert choose_fork(cost, [0.0] * 3, lookup, 3, kl_max)[0] == 0  # a draft never accepted is not run
    assert min(drafts_alone, lookups_alone, forks) > 10, (drafts_alone, lookups_alone, forks)


@pytest.mark.parametrize("mode", ["domino", "dflash"])
@pytest.mark.parametrize("num_draft", [None, "auto"])
@pytest.mark.parametrize("static", [False, True])
def test_greedy_fork_equals_ar(mode, num_draft, static):
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    options = dataclasses.replace(FORK, cuda_graphs="static", graph_capacity=96) if static else FORK
    engine = SpecEngine(target, draft, mode, num_draft, options)
    assert engine.max_verify == 3 + 7
    engine.cost = streaming_cost(engine.max_verify)  # auto-K: a fixed cost table, not this machine's timing
    stats = stats_equal_to_ar(engine, ar)
    forks, lookup_wins = sum(s.fork_rounds for s in stats), sum(s.fork_lookup_wins for s in stats)
    assert lookup_wins > 5 and forks - lookup_wins > 5, (forks, lookup_wins)


def test_sampling_never_forks():
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    engine = SpecEngine(target, tiny_draft(target, block_size=4, head=True), "domino", None, FORK)
    lookups = 0
    for i, prompt in enumerate(repetitive_prompts(6, 8, seed=3)):
        out = engine.generate(prompt, 24, Sampling(temperature=1.0), seed=i)
        assert out.stats.fork_rounds == 0
        lookups += out.stats.lookup_rounds
    assert lookups > 0
