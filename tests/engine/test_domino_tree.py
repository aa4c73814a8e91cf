"""DominoTree (engine.domino_tree, accept, tree_policy, proposers; mode `dominotree`).

- The depth-by-depth build equals a textbook max-heap best-first build (one node at a time, each
  path's own GRU state and correction), full vocabulary and pooled, greedy and warped scores.
- Every prefix of the nodes is a tree (parents first, depth = parent's + 1, scores non-increasing);
  the verify rows see exactly their ancestors, a lookup chain under x_start included.
- Greedy decoding equals AR token for token (fixed budget and auto-K, lookups beside the tree,
  a pool, dynamic, static and lean caches), and the caches keep prompt + answer - 1 rows.
- Sampling is lossless: chi-square of the engine's x2 and (x2, x3) against the target's exact
  distribution passes in tree mode; the same test fails when the residual keeps the rejected
  children's mass. The recursive rejection over one node is checked alone as well.
- Auto-budget: TreeModel's survival against counts by hand; choose_nodes against a brute force.
- Bad settings are refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections import Counter

import numpy as np
import pytest
import torch
from engine_helpers import engine_params, random_prompts, repetitive_prompts, stats_equal_to_ar, streaming_cost, tiny_draft, tiny_target
from test_lossless_sampling import VOCAB, chi_square_p, exact_joint, marginals, sample_x2_x3
from scipy.stats import chi2

import dominospec.engine.accept as accept_module
from dominospec.engine.accept import Accepted, children_of
from dominospec.engine import Sampling, SpecEngine
from dominospec.engine.domino_tree import ancestor_bits, grow_tree
from dominospec.engine.policy import PRIOR, PRIOR_WEIGHT, RoundCost
from dominospec.engine.draft_head import candidate_pool
from dominospec.engine.accept import GreedyWalk, accept_sampled
from dominospec.engine.tree_policy import TreeModel, choose_nodes
from dominospec.errors import UserError


def block(target, draft, K: int, seed: int):
    """A random block's z [K, H], u [K, V] and x_start, as the draft forward would give them."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(K, draft.config.hidden_size, generator=g, dtype=target.embed_tokens.weight.dtype)
    with torch.inference_mode():
        u = target.lm_head(z)
    return z, u, torch.randint(3, target.identity.vocab_size - 1, (1,), generator=g)


def heap_tree(draft, embed, z, u, x_start, nodes, children, pool_size, sampling) -> dict:
    """Reference: a max-heap over cumulative log q, one node popped and expanded at a time ->
    {path (token tuple): score}."""
    K, P = u.shape[0], int(draft.config.pure_draft_prefix_len)
    cand = candidate_pool(u, P, pool_size)
    order = itertools.count()
    frontier: list = []

    def offer(path: tuple, state, score: float) -> None:
        j = len(path)
        if j >= K:
            return
        logits = u[j] if j < P else u[j] + draft.correction(z[j][None], state)[0]
        ids = torch.arange(u.shape[1]) if j < P or cand is None else cand
        logits = logits[ids]
        logq = torch.log_softmax(logits.double(), -1) if sampling.greedy else sampling.probs(logits[None])[0].double().log()
        top = logq.topk(min(children, logq.numel()))
        for value, index in zip(top.values.tolist(), top.indices.tolist()):
            heapq.heappush(frontier, (-(score + value), next(order), path + (int(ids[index]),), state))

    tree: dict = {}
    offer((), draft.gru_step(embed(x_start), z.new_zeros(1, draft.config.gru_hidden_dim)), 0.0)
    while frontier and len(tree) < nodes:
        neg, _, path, parent_state = heapq.heappop(frontier)
        tree[path] = -neg
        offer(path, draft.gru_step(embed(torch.tensor([path[-1]])), parent_state), -neg)
    return tree


def paths_of(tree) -> dict:
    """A DraftTree -> {path (token tuple): score}, checking on the way that every prefix is a tree."""
    tokens, parents, depth, scores = (t.tolist() for t in (tree.tokens, tree.parents, tree.depth, tree.scores))
    paths: dict = {}
    rows = [()]  # row -> path
    for i, (t, p, d) in enumerate(zip(tokens, parents, depth)):
        assert 0 <= p <= i, "a node's parent must precede it"
        assert d == len(rows[p]) + 1
        if i:
            assert scores[i] <= scores[i - 1] + 1e-12, "best first"
        rows.append(rows[p] + (t,))
        paths[rows[-1]] = scores[i]
    return paths


@pytest.mark.parametrize("pool, sampling", [(0, Sampling()), (24, Sampling()), (0, Sampling(temperature=0.7, top_p=0.9)),
                                            (24, Sampling(temperature=1.3))], ids=["full", "pool", "warped", "pool-warped"])
@pytest.mark.parametrize("nodes, children", [(1, 4), (6, 2), (15, 3), (40, 4)])
def test_depth_by_depth_build_equals_the_heap(pool, sampling, nodes, children):
    target = tiny_target("qwen3", vocab=64, dtype=torch.float64, seed=3)
    draft = tiny_draft(target, block_size=5, seed=4)
    with torch.inference_mode():
        for seed in range(3):
            z, u, x = block(target, draft, 4, seed)
            ours = grow_tree(draft, z, u, x, target.embed_tokens, nodes, children, pool, sampling)
            reference = heap_tree(draft, target.embed_tokens, z, u, x, nodes, children, pool, sampling)
            got = paths_of(ours)
            assert got.keys() == reference.keys()
            for path, score in reference.items():  # fp64 scores; warped q is float32 (Sampling.probs)
                assert got[path] == pytest.approx(score, abs=1e-9 if sampling.greedy else 1e-5)
            assert ours.size == min(nodes, sum(min(nodes, children ** d) for d in range(1, 5)))


def test_verify_rows_see_their_ancestors_and_the_lookup_chain():
    target = tiny_target("llama", vocab=32, dtype=torch.float64)
    draft = tiny_draft(target, block_size=5, seed=2)
    with torch.inference_mode():
        z, u, x = block(target, draft, 4, 0)
        tree = grow_tree(draft, z, u, x, target.embed_tokens, 12, 3, 0)
    for n, lookup in [(12, 0), (5, 3), (0, 2), (1, 1)]:
        shape, parents = tree.verify_rows(n, lookup)
        parent = [0] + tree.parents[:n].tolist() + [0 if k == 1 else n + k - 1 for k in range(1, lookup + 1)]
        assert parents.tolist() == parent
        T = 1 + n + lookup
        for i in range(T):
            seen, row, depth = {i}, i, 0
            while row:
                row, depth = parent[row], depth + 1
                seen.add(row)
            assert shape.mask()[i].nonzero().flatten().tolist() == sorted(seen)
            assert int(shape.depth[i]) == depth
        assert shape.bits is not None and shape.bits.shape == (T, 1)
    assert ancestor_bits(torch.tensor([0, 0, 1]), 2).tolist() == [[1], [3], [7]]


TREE = engine_params(tree=dict(nodes=9, children=3))
TREE_FORK = engine_params(tree=dict(nodes=9, children=3), ngram_assist=True, ngram_fork=True, ngram_max=3)
TREE_POOL = engine_params(tree=dict(nodes=7, children=2), candidate_pool=5, draft_dtype="float32")


@pytest.mark.parametrize("num_draft", [None, "auto"])
@pytest.mark.parametrize("runner", ["dynamic", "static", "lean"])
@pytest.mark.parametrize("options", [TREE, TREE_FORK, TREE_POOL], ids=["tree", "tree+lookup", "pool"])
def test_greedy_dominotree_equals_ar(num_draft, runner, options):
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    if runner != "dynamic":
        options = dataclasses.replace(options, cuda_graphs="static", graph_capacity=128, lean_target="on" if runner == "lean" else "off")
    engine = SpecEngine(target, draft, "dominotree", num_draft, options)
    assert engine.max_verify == options.tree.nodes + (7 if options.ngram_fork else 0)
    assert (engine.runners.lean is not None) == (runner == "lean")
    engine.cost = streaming_cost(engine.max_verify)  # auto-K: a fixed cost table, not this machine's timing
    stats = stats_equal_to_ar(engine, ar)
    trees, side_wins = sum(s.tree_rounds for s in stats), sum(s.tree_side_wins for s in stats)
    assert trees > 20 and side_wins > 5, (trees, side_wins)
    if options.ngram_fork:
        assert sum(s.fork_lookup_wins for s in stats) > 0  # the lookup chain beside the tree wins too


def test_auto_budget_re_solves_its_plan_every_few_rounds(monkeypatch):
    """DominoTree's plan is solved once per REPLAN_ROUNDS rounds (and lookup length), not every round,
    and what it uses is choose_nodes on the model as it stood at that solve; greedy output stays AR's."""
    import dominospec.engine.proposers as proposers

    solves = []  # (the survival a solve read, its answer)
    real = proposers.choose_nodes

    def counted(cost, survival, lookup, nodes_max, kl_max):
        answer = real(cost, survival, lookup, nodes_max, kl_max)
        solves.append((np.array(survival, copy=True), answer))
        return answer

    monkeypatch.setattr(proposers, "choose_nodes", counted)
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    engine = SpecEngine(target, draft, "dominotree", "auto", TREE)
    engine.cost = streaming_cost(engine.max_verify)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    stats = stats_equal_to_ar(engine, ar)
    rounds = sum(s.rounds for s in stats)
    generations = len(stats)
    # without lookups one solve an epoch of REPLAN_ROUNDS rounds (a generation's first round is unplanned)
    assert rounds // proposers.REPLAN_ROUNDS - generations <= len(solves) <= rounds // proposers.REPLAN_ROUNDS + generations
    assert len({answer for _, answer in solves}) > 1, "the budget moves with the model across solves"
    for survival, answer in solves:
        assert answer == real(engine.cost, survival, [], engine.proposer.nodes, 0)


def test_dominotree_accepts_more_than_the_chain_on_the_same_draft():
    """On the same random draft a 9-node tree of depth 3 accepts more than the 3-draft chain (it holds
    that chain's first node, and the draft's other guesses besides)."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    chain, tree = SpecEngine(target, draft, "domino", params=engine_params()), SpecEngine(target, draft, "dominotree", None, TREE)
    taus = []
    for engine in (chain, tree):
        outs = [engine.generate(p, 24).stats for p in random_prompts(12, 8, seed=2)]
        taus.append(sum(s.round_tokens for s in outs) / sum(s.rounds for s in outs))
    assert taus[1] > taus[0] + 0.1, taus


SAMPLED = [
    (Sampling(temperature=1.0), engine_params(tree=dict(nodes=6, children=3))),
    (Sampling(temperature=0.7), engine_params(tree=dict(nodes=4, children=2), candidate_pool=3)),
    (Sampling(temperature=1.5, top_p=0.9), engine_params(tree=dict(nodes=6, children=3), ngram_assist=True, ngram_max=2)),
]
SAMPLES, BROKEN_SAMPLES = 2000, 1000


@pytest.fixture(scope="module")
def sampled_setup():
    target = tiny_target("llama", vocab=VOCAB, dtype=torch.float64, scale=0.25, layers=2, seed=4)
    draft = tiny_draft(target, block_size=4, seed=5, scale=0.2)
    return target, draft


@pytest.mark.parametrize("sampling, options", SAMPLED)
def test_sampled_dominotree_matches_target_distribution(sampled_setup, sampling, options):
    target, draft = sampled_setup
    x2_exact, pair_exact = marginals(exact_joint(target, sampling))
    engine = SpecEngine(target, draft, "dominotree", None, options)
    x2, pairs, accepted = sample_x2_x3(engine, sampling, SAMPLES)
    assert SAMPLES * 0.1 < accepted < SAMPLES * 0.95, f"acceptance {accepted}/{SAMPLES}: drafts too good or too bad"
    assert chi_square_p(x2, x2_exact, SAMPLES) > 1e-3
    assert chi_square_p(pairs, pair_exact, SAMPLES) > 1e-3


def test_a_wrong_residual_fails_the_same_test(sampled_setup, monkeypatch):
    target, draft = sampled_setup
    sampling = Sampling(temperature=1.0)
    x2_exact, pair_exact = marginals(exact_joint(target, sampling))
    monkeypatch.setattr(accept_module, "residual", lambda p, rejected: p)  # the rejected children keep their mass
    engine = SpecEngine(target, draft, "dominotree", None, SAMPLED[0][1])
    x2, pairs, _ = sample_x2_x3(engine, sampling, BROKEN_SAMPLES)
    assert min(chi_square_p(x2, x2_exact, BROKEN_SAMPLES), chi_square_p(pairs, pair_exact, BROKEN_SAMPLES)) < 1e-6


SAMPLED_FORK = engine_params(tree=dict(nodes=6, children=3), ngram_assist=True, ngram_fork=True, ngram_max=2)


def test_sampled_dominotree_with_the_fork_matches_target_distribution(sampled_setup):
    """DominoTree sampled with the default's options (mode dominotree: the default `domino` samples its chain), the fork
    on (greedy-only, so a lookup hit is verified instead of the tree): both kinds of round come, and the tokens
    follow the target."""
    target, draft = sampled_setup
    sampling = Sampling(temperature=1.0)
    x2_exact, pair_exact = marginals(exact_joint(target, sampling))
    engine = SpecEngine(target, draft, "dominotree", None, SAMPLED_FORK)
    assert engine.mode == "dominotree" and engine.proposer.fork
    seen: list = []
    x2, pairs, accepted = sample_x2_x3(engine, sampling, SAMPLES, seen)
    assert SAMPLES * 0.1 < accepted < SAMPLES * 0.95, f"acceptance {accepted}/{SAMPLES}: drafts too good or too bad"
    lookups, trees = sum(s.lookup_rounds for s in seen), sum(s.tree_rounds for s in seen)
    assert lookups > SAMPLES * 0.05 and trees > SAMPLES * 0.1, (lookups, trees)
    assert chi_square_p(x2, x2_exact, SAMPLES) > 1e-3
    assert chi_square_p(pairs, pair_exact, SAMPLES) > 1e-3


def always_first_child(ids, parents, probs, q, generator):
    """A wrong acceptance: every row's first child taken (the draft's best token, or the lookup), down
    to a leaf; the next token from p there."""
    kids = children_of(parents[: probs.shape[0]].tolist())
    path = [0]
    while kids[path[-1]]:
        path.append(kids[path[-1]][0])
    nxt = int(torch.multinomial(probs[path[-1]][None], 1, generator=generator)[0, 0])
    return Accepted(path, [int(ids[r]) for r in path[1:]] + [nxt], None)


def test_always_accepting_fails_the_same_test_with_the_fork(sampled_setup, monkeypatch):
    target, draft = sampled_setup
    sampling = Sampling(temperature=1.0)
    x2_exact, pair_exact = marginals(exact_joint(target, sampling))
    monkeypatch.setattr(accept_module, "accept_sampled", always_first_child)
    engine = SpecEngine(target, draft, "dominotree", None, SAMPLED_FORK)
    x2, pairs, _ = sample_x2_x3(engine, sampling, BROKEN_SAMPLES)
    assert min(chi_square_p(x2, x2_exact, BROKEN_SAMPLES), chi_square_p(pairs, pair_exact, BROKEN_SAMPLES)) < 1e-6


def test_recursive_rejection_at_one_node_draws_from_p():
    """Row 0 with children tokens 3, 1, 6 (a grandchild under 1): the committed first token follows p."""
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.02, 0.08, 0.15, 0.05], dtype=torch.float64)
    probs = p.expand(5, -1).clone()
    tokens, parents = torch.tensor([0, 3, 1, 6, 2]), torch.tensor([0, 0, 0, 0, 2])
    g = torch.Generator().manual_seed(0)
    n = 4000
    first = Counter()
    for _ in range(n):
        out = accept_sampled(tokens, parents, probs, None, g)
        rows = out.rows
        assert rows[0] == 0 and all(int(parents[b]) == a for a, b in zip(rows, rows[1:]))
        assert out.tokens[:-1] == [int(tokens[r]) for r in rows[1:]]
        first[out.tokens[0]] += 1
    observed = torch.tensor([first[v] for v in range(8)], dtype=torch.float64)
    stat = float(((observed - n * p) ** 2 / (n * p)).sum())
    assert chi2.sf(stat, 7) > 1e-3


def test_greedy_walk_takes_the_longest_accepted_path():
    # rows: 0 root; 1 (tok 5) and 2 (tok 5, a lookup repeating it) under 0; 3 (tok 7) under 1; 4 (tok 7), 5 (tok 4) under 2
    tokens, parents = torch.tensor([9, 5, 5, 7, 7, 4]), torch.tensor([0, 0, 0, 1, 2, 4])
    choice = [5, 7, 7, 1, 4, 0]  # the target's argmax after each row
    logits = torch.nn.functional.one_hot(torch.tensor(choice), 10).double()
    walk = GreedyWalk(tokens, parents, logits)
    assert walk.path(range(1, 6)) == [2, 4, 5]  # three accepted through the lookup's rows
    assert walk.path(range(1, 4)) == [1, 3]
    assert walk.choice[5] == 0


def test_tree_model_survival_by_hand_and_its_prior():
    model, k = TreeModel(nodes=4, depth=3, window=4), 0.75  # every round keeps 3/4 of the counts
    assert model.unseen
    model.update(4, [(0, 1), (2, 2)])  # accepted rank 0 at depth 1, rank 2 at depth 2
    model.update(2, [(1, 1)])  # only ranks 0, 1 verified; rank 1 accepted at depth 1
    model.update(4, [])
    assert not model.unseen
    shares = model.rank_shares().tolist()
    tried01, tried23 = (k + 1) * k + 1, k * k + 1
    assert shares[0] == pytest.approx([(k * k + 0.5) / (tried01 + 1), 0.0, 0.0])  # prior: a first draft half the time
    assert shares[1] == pytest.approx([(k + shares[0][0]) / (tried01 + 1), 0.0, 0.0])
    assert shares[2] == pytest.approx([shares[1][0] / (tried23 + 1), k * k / (tried23 + 1), 0.0])  # prior: rank 1's shares
    assert shares[3] == pytest.approx([s / (tried23 + 1) for s in shares[2]])
    s = model.survival()
    assert s[0] == [0.0, 0.0, 0.0]
    assert s[1][0] == pytest.approx(shares[0][0])
    assert s[3][1] == pytest.approx(min(s[3][0], sum(shares[r][1] for r in range(3))))
    for row in s:
        assert all(a >= b for a, b in zip(row, row[1:])) and max(row) <= 1.0
    for lo, hi in zip(s, s[1:]):
        assert all(a <= b + 1e-12 for a, b in zip(lo, hi))


def test_tree_model_shares_in_blocks_equal_the_plain_recurrence():
    """The blocked solve of share[r] = (hit[r] + w share[r-1]) / (tried[r] + w) against the loop, over
    several blocks and a padded last one, with counts large enough that b's products underflow."""
    rng = random.Random(1)
    for nodes, window, rounds in [(100, 8, 40), (256, 1000, 400), (33, 4, 5), (1, 8, 3)]:
        model = TreeModel(nodes, 5, window)
        for _ in range(rounds):
            verified = rng.randint(0, nodes)
            ranks = sorted(rng.sample(range(nodes), min(nodes, rng.randint(0, 5))))
            model.update(verified, [(r, d + 1) for d, r in enumerate(ranks)])
        expected, prior = [], [PRIOR] + [0.0] * 4
        for tried, hit in zip(model.tried.tolist(), model.hit.tolist()):
            prior = [(h + PRIOR_WEIGHT * p) / (tried + PRIOR_WEIGHT) for h, p in zip(hit, prior)]
            expected.append(prior)
        got = model.rank_shares()
        assert got.shape == (nodes, 5)
        assert np.allclose(got, expected, rtol=1e-12, atol=1e-300)


def test_choose_nodes_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        N, kl_max, depth = rng.randint(1, 8), rng.randint(0, 4), 4
        verify = sorted(rng.uniform(5, 15) for _ in range(N + kl_max + 1))
        cost = RoundCost(verify=verify, draft=rng.uniform(0, 3), rollout_step=0.1, tree_build=rng.uniform(0, 2))
        model = TreeModel(N, depth, 8)
        for _ in range(rng.randint(0, 10)):
            path_len = rng.randint(0, depth)
            model.update(rng.randint(0, N), [(r, d + 1) for d, r in enumerate(sorted(rng.sample(range(N), min(path_len, N))))])
        s = model.survival()
        lookup = sorted((rng.random() for _ in range(kl_max)), reverse=True)
        best, best_rate = (0, 0), 1.0 / cost.verify[0]
        for n in range(N + 1):
            for kl in range(kl_max + 1):
                if n == kl == 0:
                    continue
                tree = s[n] + [0.0] * kl_max
                e = 1.0 + sum(s[n]) + sum((1 - tree[k]) * lookup[k] for k in range(kl))
                rate = e / ((cost.draft + cost.tree_build if n else 0.0) + cost.verify[n + kl])
                if rate > best_rate + 1e-12:
                    best, best_rate = (n, kl), rate
        assert choose_nodes(cost, s, lookup, N, kl_max) == best


def test_bad_tree_settings_are_refused(target, draft):
    for options, word in [(engine_params(tree=dict(nodes=0)), "tree.nodes"), (engine_params(tree=dict(children=0)), "tree.children"),
                          (engine_params(tree=dict(nodes=257)), "tree.nodes is at most 256")]:
        with pytest.raises(UserError, match=word):
            SpecEngine(target, draft, "dominotree", None, options)
    no_head = tiny_draft(target, block_size=4, head=False)
    with pytest.raises(UserError, match="dominotree.*Domino head"):
        SpecEngine(target, no_head, "dominotree", params=engine_params())
    lean = engine_params(tree=dict(nodes=256), ngram_assist=True, ngram_fork=True, ngram_num_draft=70, cuda_graphs="static", lean_target="on", graph_capacity=64)
    with pytest.raises(UserError, match="327 rows, over 320"):
        SpecEngine(target, draft, "dominotree", None, lean)


def test_sampled_rounds_and_lookups_keep_the_caches_in_step():
    """Sampled dominotree with lookups replacing the draft on a hit: the caches hold prompt + answer - 1."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    engine = SpecEngine(target, draft, "dominotree", "auto", engine_params(tree=dict(nodes=9), ngram_assist=True, ngram_max=3))
    engine.cost = streaming_cost(engine.max_verify)
    lookups = 0
    for i, prompt in enumerate(repetitive_prompts(6, 8, seed=3)):
        out = engine.generate(prompt, 24, Sampling(temperature=0.8), seed=i)
        s = out.stats
        assert s.draft_context_length == s.target_kv_length == len(prompt) + len(out.token_ids) - 1
        lookups += s.lookup_rounds
    assert lookups > 0


def test_domino_drafts_the_tree_engine_tree_shape_names():
    """`domino` follows engine.tree.shape: best_first is DominoTree (the same tokens and rounds as mode
    dominotree, which ignores the shape), chain is the head's chain; dflash never grows a tree."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    best_first = SpecEngine(target, draft, "domino", None, TREE.with_tree(shape="best_first"))
    tree = SpecEngine(target, draft, "dominotree", None, TREE.with_tree(shape="chain"))
    assert (best_first.mode, best_first.nodes, best_first.grower is not None) == ("dominotree", 9, True)
    for prompt in random_prompts(3, 8, seed=4):
        a, b = best_first.generate(prompt, 16), tree.generate(prompt, 16)
        assert a.token_ids == b.token_ids and a.stats.round_tokens == b.stats.round_tokens
    for shape, mode in [("chain", "domino"), ("best_first", "dflash")]:
        engine = SpecEngine(target, draft, mode, None, TREE.with_tree(shape=shape))
        assert (engine.mode, engine.nodes, engine.grower) == (mode, 0, None)
