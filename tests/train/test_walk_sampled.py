"""The sampled val walk (train/walk.py) predicts the engine's sampled τ.

Sampled, a round's draft i is accepted, given drafts < i were, with probability
a_i = Σ_v min(p_i, q_i); the walk chains these along each val reply into an expected τ. The walk
reads p and q along the reply's own tokens, so it is exact where they do not depend on which
tokens were sampled: a tiny fp64 target whose embedding rows are all equal has the same hidden
state at every position, hence one next-token distribution p, and its draft sees the same
features and block inputs every round (the head's GRU still moves q from slot to slot). There the
engine's pooled τ over many seeded generations must equal the walk's expectation within four
standard errors, and the test checks that the same tolerance rejects wrong formulas (the greedy
walk's τ, acceptance read as Σ p·q). Measured: head on, engine 3.234 ± 0.034 against the walk's
3.215; greedy 3.83, Σ p·q 2.99.
Run: python -m pytest tests/train/test_walk_sampled.py -q
"""

import math

import pytest
import torch

from engine_helpers import engine_params, tiny_draft, tiny_target  # noqa: E402

from dominospec.cache.features import target_hidden  # noqa: E402
from dominospec.engine import Sampling, SpecEngine  # noqa: E402
from dominospec.train.walk import WalkStats, walk_reply_sampled, walk_sequence  # noqa: E402

LAYER_IDS, K, NEW, RUNS = [0, 2], 4, 24, 240
PROMPT = [3, 5, 4, 6]
SAMPLING = Sampling(temperature=0.8)


def test_expected_walk_of_known_acceptance():
    """a = (1, 0) at every anchor of a 7-token reply, K = 2: rounds of 2 tokens exactly; a = 0: of 1."""
    always = {a: torch.tensor([1.0, 0.0]) for a in range(7)}
    stats = walk_reply_sampled(always, 0, 7, 2)
    assert (stats.emitted, stats.rounds) == (6, 3.0)
    never = {a: torch.zeros(2) for a in range(7)}
    assert walk_reply_sampled(never, 0, 7, 2).rounds == 6.0
    half = {a: torch.tensor([0.5, 0.5]) for a in range(3)}  # reply 0..2: one round at a = 0 with k = 1 draft
    stats = walk_reply_sampled(half, 0, 3, 2)
    assert stats.rounds == pytest.approx(1.5) and stats.position_accepted[0] == pytest.approx(0.5)


def flat_target():
    """A tiny fp64 Qwen3 target whose input embeddings are all one row: p is the same at every position."""
    target = tiny_target("qwen3", vocab=16, dtype=torch.float64, scale=0.6, seed=2)
    with torch.no_grad():
        emb = target.model.get_input_embeddings().weight
        emb.copy_(emb[5].expand_as(emb))
    return target


def engine_tau(engine: SpecEngine) -> tuple[float, float, float]:
    """RUNS seeded sampled generations of NEW tokens -> (pooled τ, its standard error, mean rounds)."""
    engine.stop_ids = frozenset()
    rounds, emitted = [], []
    for seed in range(RUNS):
        stats = engine.generate(PROMPT, NEW, SAMPLING, seed=seed).stats
        rounds.append(stats.rounds)
        emitted.append(stats.round_tokens)
    assert set(emitted) == {NEW - 1}
    r = torch.tensor(rounds, dtype=torch.float64)
    tau = (NEW - 1) / float(r.mean())
    return tau, tau * float(r.std()) / float(r.mean()) / math.sqrt(RUNS), float(r.mean())  # delta method


def walk(target, draft, reply: list[int], head: bool, temperature) -> WalkStats:
    ids = torch.tensor(PROMPT + reply)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(PROMPT):] = True
    with torch.no_grad():
        feats = target_hidden(target.model, ids[None], torch.ones(1, len(ids), dtype=torch.long), LAYER_IDS)[0].clone()
        logits = target.model(input_ids=ids[None]).logits[0]
    return walk_sequence(draft, target.embed_tokens, target.lm_head, ids, mask, feats, K, head=head,
                         chunk=7, temperature=temperature, target_logits=logits)


@pytest.mark.parametrize("head", [True, False])
def test_sampled_walk_equals_the_engines_mean_tau(head):
    target = flat_target()
    draft = tiny_draft(target, block_size=K + 1, head=head, seed=3, scale=0.25)
    engine = SpecEngine(target, draft, "domino" if head else "dflash", params=engine_params())
    tau, se, _ = engine_tau(engine)
    reply = engine.generate(PROMPT, NEW, SAMPLING, seed=10_000).token_ids  # any reply: p and q do not depend on it
    predicted = walk(target, draft, reply, head, SAMPLING.temperature)
    assert predicted.emitted == NEW - 1
    assert 1.3 < tau < K + 0.7, tau  # drafts accepted often, not always: the chain's structure matters
    assert abs(predicted.acceptance_length - tau) < 4 * se, (predicted.acceptance_length, tau, se)

    # The same tolerance rejects what a wrong walk would predict.
    greedy = walk(target, draft, reply, head, None).acceptance_length
    assert abs(greedy - tau) > 4 * se, ("greedy", greedy, tau, se)
    import dominospec.train.walk as W

    real = W.acceptance_probability
    try:
        W.acceptance_probability = lambda p, q: (p * q).sum(-1)  # Σ p·q: two independent draws agreeing
        wrong = walk(target, draft, reply, head, SAMPLING.temperature).acceptance_length
    finally:
        W.acceptance_probability = real
    assert abs(wrong - tau) > 4 * se, ("sum p q", wrong, tau, se)
