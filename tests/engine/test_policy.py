"""Auto-K (engine.policy): the choice of K from a round cost and acceptance by position.

Hand-computable cases: the expected-tokens-per-ms rule, the acceptance counts, the fall-back to
plain steps when drafts fail and the probe that follows once the evidence has faded.
Run: python -m pytest tests/engine/test_policy.py -q
"""

import pytest

from dominospec.engine.policy import PRIOR, AcceptanceModel, RoundCost, choose_k, expected_rates

FLAT = RoundCost(verify=[10.0] * 8, draft=2.0, rollout_step=0.5)  # verify cost flat in the rows


def test_round_cost_by_k():
    cost = RoundCost(verify=[10.0, 11.0, 12.0, 14.0], draft=3.0, rollout_step=0.5)
    assert cost.round_ms(0) == 10.0  # a plain step: no draft forward
    assert cost.round_ms(1) == 3.0 + 0.5 + 11.0
    assert cost.round_ms(3) == 3.0 + 1.5 + 14.0
    assert cost.lookup_ms(3) == 14.0 and cost.lookup_ms(0) == 10.0  # a lookup pays the verify alone


def test_a_lookup_pays_where_a_draft_does_not():
    """The same acceptance, a = 0.2 at position 1: 1.2 tokens for 12.5 ms (draft) loses to a plain
    step (1 per 10 ms), 1.2 for 10 ms (lookup) wins."""
    survival = [0.2] + [0.0] * 6
    assert choose_k(FLAT, survival, 7) == 0
    assert choose_k(FLAT, survival, 7, lookup=True) == 1
    assert expected_rates(FLAT, survival, 7, lookup=True)[1] == pytest.approx(1.2 / 10.0)


def test_choose_k_trades_acceptance_against_cost():
    assert choose_k(FLAT, [1.0] * 7, 7) == 7  # everything accepted, flat cost: verify all
    assert choose_k(FLAT, [0.0] * 7, 7) == 0  # nothing accepted: plain steps
    # a_1 = 0.1: E(1) / C(1) = 1.1 / 12.5 < 1 / 10, so no draft pays
    assert choose_k(FLAT, [0.1] + [0.0] * 6, 7) == 0
    # a = 0.9, 0.8, 0.1, ...: rates 1.9/12.5, 2.7/13, 2.8/13.5 ... -> K = 2
    survival = [0.9, 0.8, 0.1, 0.05, 0.0, 0.0, 0.0]
    rates = expected_rates(FLAT, survival, 7)
    assert rates[2] == pytest.approx(2.7 / 13.0)
    assert choose_k(FLAT, survival, 7) == 2


def test_acceptance_counts_by_position():
    model = AcceptanceModel(k_max=4, window=10**9)  # (almost) no decay
    model.update(3, 1)  # d_1 accepted, d_2 rejected, d_3 never judged
    assert model.tried[:3] == pytest.approx([1, 1, 0]) and model.hit[:3] == pytest.approx([1, 0, 0])
    model.update(4, 4)
    assert model.tried == pytest.approx([2, 2, 1, 1]) and model.hit == pytest.approx([2, 1, 1, 1])
    fresh = AcceptanceModel(k_max=3, window=32)
    assert fresh.survival() == pytest.approx([PRIOR, PRIOR**2, PRIOR**3])  # the prior, position by position


def test_failing_drafts_fall_back_to_plain_steps_then_probe_again():
    model = AcceptanceModel(k_max=7, window=32)
    for _ in range(5):
        model.update(choose_k(FLAT, model.survival(), 7) or 1, 0)  # drafts are always rejected
    assert choose_k(FLAT, model.survival(), 7) == 0
    plain = 0
    while choose_k(FLAT, model.survival(), 7) == 0:
        model.update(0, 0)
        plain += 1
        assert plain < 500, "never probes again"
    assert plain >= 5  # the evidence fades over several rounds, not at once


def test_accepting_drafts_raise_k_to_the_maximum():
    model = AcceptanceModel(k_max=7, window=32)
    for _ in range(20):
        k = choose_k(FLAT, model.survival(), 7)
        model.update(k, k)  # every proposed draft accepted
    assert choose_k(FLAT, model.survival(), 7) == 7


def test_auto_k_sampled_answers_reproduce_by_seed(target, draft):
    """K follows only the generation's own rounds (and the cost measured once): a seed reproduces."""
    from engine_helpers import engine_params, random_prompts

    from dominospec.engine import Sampling, SpecEngine

    engine = SpecEngine(target, draft, "domino", "auto", params=engine_params())
    sampling = Sampling(temperature=1.0)
    for prompt in random_prompts(4, 8, seed=3):
        first = engine.generate(prompt, 20, sampling, seed=11)
        engine.generate(prompt[::-1], 20, sampling, seed=5)  # other traffic in between
        again = engine.generate(prompt, 20, sampling, seed=11)
        assert again.token_ids == first.token_ids
        assert again.stats.accepted_lengths == first.stats.accepted_lengths


def test_verify_costs_are_fitted_nondecreasing():
    """The isotonic fit against brute force: the closest non-decreasing sequence in least squares,
    searched over a fine grid for short sequences; already-sorted input is returned unchanged."""
    import itertools
    import random

    from dominospec.engine.cost import nondecreasing

    rng = random.Random(0)
    assert nondecreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
    assert nondecreasing([3.0, 1.0]) == [2.0, 2.0]
    assert nondecreasing([27.1, 33.9, 31.3, 34.0]) == [27.1, 32.6, 32.6, 34.0]
    grid = [x / 4 for x in range(0, 41)]
    for _ in range(40):
        values = [rng.choice(grid) for _ in range(3)]
        fit = nondecreasing(values)
        assert all(a <= b + 1e-12 for a, b in zip(fit, fit[1:]))
        best = min((c for c in itertools.product(grid, repeat=3) if c[0] <= c[1] <= c[2]),
                   key=lambda c: sum((a - b) ** 2 for a, b in zip(c, values)))
        error = sum((a - b) ** 2 for a, b in zip(fit, values))
        assert error <= sum((a - b) ** 2 for a, b in zip(best, values)) + 1e-9, (values, fit, best)
