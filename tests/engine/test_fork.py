"""Fork rounds (engine.fork): the draft's chain and a prompt lookup verified as two branches of one forward.

- `fork_tree` equals a mask written out by hand from the rule: a row sees row 0 and its own
  branch's earlier rows.
- On both target runners (dynamic cache, and the static one the CUDA graphs replay), a fork
  forward gives each branch the logits and features of verifying that branch alone (fp64); after
  `select` + crop to the lookup branch, the next forward equals the one after verifying the lookup
  alone: the KV rows moved into place are the right ones.
- `accept_fork` keeps the branch that accepts more; a tie keeps the chain.
- `choose_fork`: with a lookup that is never accepted it chooses the chain alone, as `choose_k`;
  a grid search written out with the independence estimate agrees on random survivals.
- Greedy decoding with ngram_fork equals AR token for token (domino, dflash; fixed K and auto-K;
  dynamic and static caches), with fork rounds won by each branch; the draft context stays in
  step with the target KV. Under sampling no round forks.
Run: python -m pytest tests/engine/test_fork.py -q
"""

import dataclasses
import random

import pytest
import torch
from engine_helpers import repetitive_prompts, stats_equal_to_ar, streaming_cost, tiny_draft, tiny_target

from dominospec.engine import EngineOptions, SpecEngine
from dominospec.engine.fork import accept_fork, chain_tree, fork_tree
from dominospec.engine.policy import RoundCost, choose_fork, choose_k
from dominospec.engine.sampling import Sampling
from dominospec.engine.target_kv import DynamicTargetKV, StaticTargetKV

FORK = EngineOptions(ngram_assist=True, ngram_fork=True, ngram_max=3)
CPU = torch.device("cpu")


def test_fork_tree_is_the_two_branch_mask():
    kd, kl = 2, 3
    branch = [0, 1, 1, 2, 2, 2]
    expected = [[j == 0 or (branch[i] == branch[j] and j <= i) for j in range(6)] for i in range(6)]
    tree = fork_tree(kd, kl, CPU)
    assert tree.visible.tolist() == expected
    assert tree.depth.tolist() == [0, 1, 2, 1, 2, 3]
    assert fork_tree(3, 0, CPU).visible.tolist() == chain_tree(4, CPU).visible.tolist()


@pytest.mark.parametrize("runner", ["dynamic", "static"])
def test_fork_forward_equals_each_branch_alone(runner):
    target = tiny_target("llama", vocab=32, dtype=torch.float64)
    layers = [0, target.num_layers - 2]

    def make():
        if runner == "dynamic":
            return DynamicTargetKV(target.model, layers)
        return StaticTargetKV(target.model, layers, capacity=64, max_rows=8, graphs=False)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 31, (1, 9), generator=g)
    x, chain, lookup = torch.tensor([[7]]), torch.randint(3, 31, (1, 3), generator=g), torch.randint(3, 31, (1, 4), generator=g)
    after = torch.randint(3, 31, (1, 2), generator=g)
    with torch.inference_mode():
        alone = {}
        for name, branch in (("chain", chain), ("lookup", lookup)):
            kv = make()
            kv.forward(prompt, keep=1)
            alone[name] = kv.forward(torch.cat([x, branch], 1), keep=1 + branch.shape[1])
            if name == "lookup":  # keep x and the first 2 lookup tokens, then one more forward
                kv.crop(9 + 3)
                next_alone = kv.forward(after, keep=2)
        kv = make()
        kv.forward(prompt, keep=1)
        logits, features = kv.forward(torch.cat([x, chain, lookup], 1), keep=8, tree=fork_tree(3, 4, CPU))
        chain_rows, lookup_rows = [0, 1, 2, 3], [0, 4, 5, 6, 7]
        torch.testing.assert_close(logits[:, chain_rows], alone["chain"][0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(features[:, chain_rows], alone["chain"][1], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(logits[:, lookup_rows], alone["lookup"][0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(features[:, lookup_rows], alone["lookup"][1], rtol=1e-10, atol=1e-10)
        kv.select(lookup_rows[:3])
        kv.crop(9 + 3)
        got = kv.forward(after, keep=2)
        torch.testing.assert_close(got[0], next_alone[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], next_alone[1], rtol=1e-10, atol=1e-10)


def one_hot_logits(rows: list[int], V: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), V).double()


def test_accept_fork_keeps_the_longer_branch():
    chain, lookup = torch.tensor([4, 5, 6]), torch.tensor([4, 8, 9])
    # target's greedy tokens by row: row 0 -> 4; chain rows (4, 5, 6) -> 5, 1, _; lookup rows (4, 8, 9) -> 8, 9, 3
    forked = accept_fork(chain, lookup, one_hot_logits([4, 5, 1, 0, 8, 9, 3]))
    assert (forked.accepted_draft, forked.accepted_lookup, forked.lookup_won) == (2, 3, True)
    assert (forked.accepted, forked.next_token, forked.rows) == (3, 3, [0, 4, 5, 6])
    forked = accept_fork(chain, lookup, one_hot_logits([4, 5, 6, 7, 0, 0, 0]))
    assert (forked.accepted, forked.next_token, forked.rows, forked.lookup_won) == (3, 7, [0, 1, 2, 3], False)
    forked = accept_fork(chain, lookup, one_hot_logits([4, 0, 0, 0, 0, 0, 0]))  # a tie at 1: the chain
    assert (forked.accepted, forked.lookup_won, forked.rows) == (1, False, [0, 1])


def _rate(cost, chain, lookup, kd, kl):
    """Expected tokens per ms of a fork round, P(either accepts >= k) = 1 - (1 - a_d)(1 - a_l)."""
    a_d, a_l = chain[:kd] + [0.0] * 8, lookup[:kl] + [0.0] * 8
    ms = (cost.draft + kd * cost.rollout_step if kd else 0) + cost.verify[kd + kl]
    return (1 + sum(1 - (1 - a_d[k]) * (1 - a_l[k]) for k in range(8))) / ms


def reference_fork_choice(cost, chain, lookup, kd_max, kl_max):
    """Brute force over the grid (`_rate`), a plain step included."""
    rates = {(kd, kl): _rate(cost, chain, lookup, kd, kl) for kd in range(kd_max + 1) for kl in range(kl_max + 1)}
    return max(rates, key=rates.get)


def test_choose_fork_against_brute_force_and_choose_k():
    rng = random.Random(0)
    for trial in range(300):
        verify = sorted(rng.uniform(10, 16) for _ in range(11))
        cost = RoundCost(verify=verify, draft=rng.uniform(0, 4), rollout_step=rng.uniform(0, 0.5))
        chain = sorted((rng.random() for _ in range(3)), reverse=True)
        lookup = sorted((rng.random() for _ in range(7)), reverse=True)
        kl_max = rng.randrange(1, 8)
        got = choose_fork(cost, chain, lookup, 3, kl_max)
        want = reference_fork_choice(cost, chain, lookup, 3, kl_max)
        assert got == want or abs(_rate(cost, chain, lookup, *got) - _rate(cost, chain, lookup, *want)) < 1e-12
        assert choose_fork(cost, chain, [0.0] * 7, 3, kl_max) == (choose_k(cost, chain, 3), 0)



@pytest.mark.parametrize("mode", ["domino", "dflash"])
@pytest.mark.parametrize("num_draft", [None, "auto"])
@pytest.mark.parametrize("static", [False, True])
def test_greedy_fork_equals_ar(mode, num_draft, static):
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    ar = SpecEngine(target, None, "ar")
    options = dataclasses.replace(FORK, static_cache=True, graph_capacity=96) if static else FORK
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
