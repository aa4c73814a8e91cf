"""Speculative sampling is lossless: its tokens follow the target's own (warped) distribution.

A tiny 8-token target, a fixed prompt, thousands of seeded generations of 4 tokens. The first
token comes from the prefill; the next ones from the first verify round (2 drafts + bonus), so
acceptance, the residual draw and the bonus draw all shape x2 and x3. The exact distribution of
(x1, x2, x3) is computed from the target's probabilities; chi-square tests compare the observed
x2 and (x2, x3) frequencies with it. The same tests must reject deliberately broken rules.
Run: python -m pytest tests/engine/test_lossless_sampling.py -q
"""

from collections import Counter

import pytest
import torch
from engine_helpers import engine_params, tiny_draft, tiny_target
from scipy.stats import chi2

import dominospec.engine.accept as accept_module
from dominospec.engine.accept import Accepted
from dominospec.engine import Sampling, SpecEngine

VOCAB, PROMPT = 8, [3, 5, 4, 6]
SAMPLES, BROKEN_SAMPLES = 2000, 1000  # broken rules miss by p < 1e-30 at 1500 samples


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab=VOCAB, dtype=torch.float64, scale=0.25, layers=2, seed=4)
    draft = tiny_draft(target, block_size=4, seed=5, scale=0.2)
    return target, draft


def exact_joint(target, sampling: Sampling) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) [V, V, V] from the target's warped next-token distributions."""
    V = VOCAB
    with torch.inference_mode():
        pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2] = (x1, x2)
        ids = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), pairs], dim=1)  # [V*V, T+2]
        logits = target.model(input_ids=ids).logits  # [V*V, T+2, V]
        p1 = sampling.probs(logits[0, len(PROMPT) - 1][None])[0]  # [V]
        p2 = sampling.probs(logits[::V, len(PROMPT)])  # [V] rows x1 -> p(x2 | x1)
        p3 = sampling.probs(logits[:, len(PROMPT) + 1]).view(V, V, V)  # p(x3 | x1, x2)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(observed: Counter, expected: torch.Tensor, n: int) -> float:
    """Pearson chi-square p-value; cells expecting < 5 samples are pooled into one."""
    expected = expected.flatten() * n
    obs = torch.zeros_like(expected)
    for cell, count in observed.items():
        obs[cell] = count
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    o = torch.cat([obs[~small], obs[small].sum()[None]])
    keep = e > 0
    assert torch.all(o[~keep] == 0), "a sample fell on a zero-probability cell"
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def sample_x2_x3(engine: SpecEngine, sampling: Sampling, n: int, seen: list | None = None) -> tuple[Counter, Counter, int]:
    """n seeded generations -> (x2 counts, (x2, x3) counts, rounds that accepted a draft); each
    generation's stats appended to `seen` when given."""
    x2, pairs, accepted = Counter(), Counter(), 0
    engine.stop_ids = frozenset()  # the exact joint has no stop token: every sample runs 4 tokens
    for seed in range(n):
        out = engine.generate(PROMPT, 4, sampling, seed=seed)
        assert len(out.token_ids) == 4
        a, b = out.token_ids[1], out.token_ids[2]
        x2[a] += 1
        pairs[a * VOCAB + b] += 1
        accepted += out.stats.position_accepted[0] > 0
        if seen is not None:
            seen.append(out.stats)
    return x2, pairs, accepted


def marginals(joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pair = joint.sum(0)  # [V, V] over (x2, x3)
    return pair.sum(1), pair


BF16_POOL = engine_params(draft_dtype="bfloat16", candidate_pool=3)  # bf16 draft path, 3 of 8 tokens scored
SAMPLINGS = [
    ("domino", Sampling(temperature=1.0), engine_params()),
    ("dflash", Sampling(temperature=2.0, top_k=6, top_p=0.8), engine_params()),  # a q warped unlike p fails (p < 1e-20)
    ("domino", Sampling(temperature=1.0), BF16_POOL),
    ("domino", Sampling(temperature=1.5, top_p=0.9), BF16_POOL),
    ("ngram", Sampling(temperature=1.0), engine_params(ngram_max=2)),  # point-mass drafts from prompt lookup
    ("domino", Sampling(temperature=1.0), engine_params(ngram_assist=True, ngram_max=2)),  # lookup hits, else the draft
    ("domino", Sampling(temperature=1.0), engine_params(ngram_assist=True, ngram_fork=True, ngram_max=2)),  # a fork is greedy-only: one branch
]


@pytest.mark.parametrize("mode, sampling, options", SAMPLINGS)
def test_spec_sampling_matches_target_distribution(setup, mode, sampling, options):
    target, draft = setup
    x2_exact, pair_exact = marginals(exact_joint(target, sampling))
    engine = SpecEngine(target, None if mode == "ngram" else draft, mode, None, options)
    x2, pairs, accepted = sample_x2_x3(engine, sampling, SAMPLES)
    low = 0.05 if mode == "ngram" else 0.1  # lookup hits only when x1 occurs in the prompt
    assert SAMPLES * low < accepted < SAMPLES * 0.9, f"acceptance {accepted}/{SAMPLES}: drafts too good or too bad"
    assert chi_square_p(x2, x2_exact, SAMPLES) > 1e-3
    assert chi_square_p(pairs, pair_exact, SAMPLES) > 1e-3


def always_accept(ids, parents, probs, q, generator):
    """Every proposed row taken (a chain: all of it), the next token from p after the last."""
    T = probs.shape[0]
    return Accepted(list(range(T)), ids[1:T].tolist() + [int(torch.multinomial(probs[T - 1][None], 1,
                                                                                 generator=generator)[0, 0])], None)


def resample_from_p(ids, parents, probs, q, generator):
    """Right acceptance test, wrong rejection draw: from p instead of the residual max(0, p - q)."""
    T = probs.shape[0]
    if T == 1:
        return Accepted([0], [int(torch.multinomial(probs[0][None], 1, generator=generator)[0, 0])], None)
    rows = torch.arange(1, T)
    tokens = ids[1:T]
    p_at = probs[rows - 1, tokens]
    q_at = q[rows - 1, tokens] if q is not None else torch.ones_like(p_at)
    u = torch.rand(T - 1, generator=generator, dtype=p_at.dtype)
    n = int((u < p_at / q_at).long().cumprod(0).sum())
    nxt = int(torch.multinomial(probs[n][None], 1, generator=generator)[0, 0])
    return Accepted(list(range(n + 1)), tokens[:n].tolist() + [nxt], None)


@pytest.mark.parametrize("broken", [always_accept, resample_from_p])
def test_broken_acceptance_rules_fail_the_same_test(setup, monkeypatch, broken):
    target, draft = setup
    sampling = Sampling(temperature=1.0)
    x2_exact, pair_exact = marginals(exact_joint(target, sampling))
    monkeypatch.setattr(accept_module, "accept_sampled", broken)
    x2, pairs, _ = sample_x2_x3(SpecEngine(target, draft, "domino", params=engine_params()), sampling, BROKEN_SAMPLES)
    n = BROKEN_SAMPLES
    assert min(chi_square_p(x2, x2_exact, n), chi_square_p(pairs, pair_exact, n)) < 1e-6


def test_sampling_warp_matches_transformers_warpers():
    """Temperature, top-k, top-p as HF generation applies them (same kept set, same probabilities)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6)]:
        ours = Sampling(temperature, top_p, top_k).probs(logits)
        scores = TemperatureLogitsWarper(temperature)(None, logits.float())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        theirs = scores.softmax(-1)
        assert torch.equal(ours > 0, theirs > 0), (temperature, top_k, top_p)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_bad_sampling_settings_are_named():
    for kwargs, word in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")]:
        with pytest.raises(ValueError, match=word):
            Sampling(**kwargs)
