"""Suite metrics: pooled τ (not a mean of per-prompt τ), exact match, divergences with the target's
top-2 margin, acceptance by position. Hand-built generations with known counts.
Run: python -m pytest tests/eval/test_report.py -q
"""

import pytest
import torch

from dominospec.engine import Generation, GenerationStats, SpecEngine
from dominospec.eval.report import acceptance_by_position, first_divergence, speedup_standard_error, suite_report

from engine_helpers import engine_params, tiny_target  # noqa: E402


def generation(mode, tokens, accepted_lengths, seconds, accepted=(0, 0), proposed=(0, 0)):
    stats = GenerationStats(mode, prompt_tokens=3, num_draft=2 if mode != "ar" else 0, new_tokens=len(tokens),
                            rounds=len(accepted_lengths), accepted_lengths=list(accepted_lengths),
                            position_accepted=list(accepted) if mode != "ar" else [],
                            position_proposed=list(proposed) if mode != "ar" else [],
                            total_s=seconds, verify_s=seconds / 2, prefill_s=0.2)
    return Generation(token_ids=list(tokens), text="", finish_reason="length", stats=stats)


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_suite_report_pools_tau_and_records_divergences_with_margin():
    target = tiny_target("llama", vocab=16, dtype=torch.float64)
    ar_engine = SpecEngine(target, None, "ar", params=engine_params())
    prompts = [[3, 4, 5], [6, 7, 8]]
    runs = [
        {"ar": generation("ar", [5, 6, 7, 8, 9], [1, 1, 1, 1], 2.0),
         "dflash": generation("dflash", [5, 6, 7, 8, 9], [2, 1, 1], 1.0, accepted=(1, 0), proposed=(3, 3)),
         "domino": generation("domino", [5, 6, 7, 8, 9], [4], 0.5, accepted=(1, 1), proposed=(1, 1))},
        {"ar": generation("ar", [9, 9, 9, 9], [1, 1, 1], 2.0),
         "dflash": generation("dflash", [9, 9, 9, 9], [1, 1, 1], 2.0, accepted=(0, 0), proposed=(3, 3)),
         "domino": generation("domino", [9, 9, 4, 4], [1, 1, 1], 1.5, accepted=(0, 0), proposed=(3, 2))},
    ]
    report = suite_report(runs, prompts, "domino", greedy=True, ar_engine=ar_engine, skipped_too_long=1)
    # pooled: (4 + 3) / (1 + 3) = 1.75, while the mean of per-prompt τ would be (4 + 1) / 2 = 2.5
    assert report["acceptance_length"] == pytest.approx(1.75)
    # SE of the ratio estimator: residuals t_i - τ r_i = 4 - 1.75 and 3 - 5.25 (±2.25), n = 2, mean r = 2
    assert report["acceptance_length_se"] == pytest.approx((2 * 2.25**2 / 2) ** 0.5 / 2)
    assert report["acceptance_length_no_head"] == pytest.approx((4 + 3) / 6)
    assert report["ar_tokens_per_s"] == pytest.approx(9 / 4.0)
    assert report["spec_tokens_per_s"] == pytest.approx(9 / 2.0)
    assert report["speedup"] == pytest.approx(2.0)
    assert report["speedup_decode"] == pytest.approx((4.0 - 0.4) / (2.0 - 0.4))  # 0.2 s prefill per prompt
    assert report["exact_match"] == 0.5 and report["exact_match_no_head"] == 1.0
    assert report["acceptance_by_position"] == [pytest.approx(1 / 4), pytest.approx(1 / 3)]
    assert report["skipped_too_long"] == 1 and report["n_prompts"] == 2
    (divergence,) = report["divergences"]
    assert {k: divergence[k] for k in ("prompt", "mode", "position", "ar_token", "spec_token")} == {
        "prompt": 1, "mode": "domino", "position": 2, "ar_token": 9, "spec_token": 4}
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([[6, 7, 8, 9, 9]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert divergence["top2_margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-6)  # computed in fp32
    assert report["max_divergence_margin"] == divergence["top2_margin"]


def test_sampled_runs_have_no_exact_match_and_positions_unproposed_are_none():
    gens = [generation("domino", [1, 2], [1], 1.0, accepted=(0, 0), proposed=(2, 0))]
    assert acceptance_by_position(gens) == [0.0, None]
    runs = [{"ar": generation("ar", [1, 2], [1], 1.0), "dflash": gens[0], "domino": gens[0]}]
    report = suite_report(runs, [[1]], "domino", greedy=False, ar_engine=None, skipped_too_long=0)
    assert report["exact_match"] is None and report["divergences"] == []


def test_speedups_have_paired_standard_errors_over_prompts():
    # Domino twice as fast as AR on both prompts: the paired SE is 0 whatever the prompts' lengths
    runs = [{"ar": generation("ar", [1] * 8, [1] * 7, 4.0),
             "ngram": generation("ngram", [1] * 8, [2] * 4, 3.0),
             "dflash": generation("dflash", [1] * 8, [2] * 4, 2.5),
             "domino": generation("domino", [1] * 8, [2] * 4, 2.0)},
            {"ar": generation("ar", [1] * 2, [1], 1.0),
             "ngram": generation("ngram", [1] * 2, [1], 0.5),
             "dflash": generation("dflash", [1] * 2, [1], 0.5),
             "domino": generation("domino", [1] * 2, [1], 0.5)}]
    report = suite_report(runs, [[1], [2]], "domino", greedy=False, ar_engine=None, skipped_too_long=0)
    assert report["speedup"] == pytest.approx(2.0) and report["speedup_se"] == pytest.approx(0.0, abs=1e-12)
    # ngram: 3/4 of AR's time on prompt 1, 1/2 on prompt 2 -> pooled 5/3.5; residuals of the ratio
    # estimator s_ar - R s_ngram: 4 - 3R and 1 - 0.5R, SE = sqrt(Σ res² / (n (n-1))) / mean(s_ngram)
    r = 5.0 / 3.5
    se = (((4 - 3 * r) ** 2 + (1 - 0.5 * r) ** 2) / (2 * 1)) ** 0.5 / ((3.0 + 0.5) / 2)
    assert report["speedup_ngram"] == pytest.approx(r) and report["speedup_ngram_se"] == pytest.approx(se)
    assert report["modes"]["ngram"]["speedup_se"] == pytest.approx(se)
    assert report["modes"]["ar"]["speedup_se"] is None
    # Domino against prompt lookup on the same prompts: 3.5 s against 2.5 s in all
    assert report["speedup_over_ngram"] == pytest.approx(3.5 / 2.5)
    r = 3.5 / 2.5
    se = (((3 - 2 * r) ** 2 + (0.5 - 0.5 * r) ** 2) / (2 * 1)) ** 0.5 / ((2.0 + 0.5) / 2)
    assert report["speedup_over_ngram_se"] == pytest.approx(se)


def test_speedup_standard_error_follows_unequal_token_counts():
    # sampled runs emit different counts: tokens/s, not seconds, is what is compared
    mode = [generation("domino", [1] * 10, [2] * 5, 1.0), generation("domino", [1] * 4, [2] * 2, 1.0),
            generation("domino", [1] * 6, [2] * 3, 2.0)]
    base = [generation("ar", [1] * 5, [1] * 4, 1.0), generation("ar", [1] * 4, [1] * 3, 2.0),
            generation("ar", [1] * 6, [1] * 5, 1.0)]
    n = 3
    speedup = (20 / 4.0) / (15 / 4.0)
    # the delta method's z_i by hand (log R = log N̄_m - log S̄_m - log N̄_b + log S̄_b)
    z = [10 / (20 / n) - 1.0 / (4 / n) - 5 / (15 / n) + 1.0 / (4 / n),
         4 / (20 / n) - 1.0 / (4 / n) - 4 / (15 / n) + 2.0 / (4 / n),
         6 / (20 / n) - 2.0 / (4 / n) - 6 / (15 / n) + 1.0 / (4 / n)]
    mean = sum(z) / n
    expected = speedup * (sum((x - mean) ** 2 for x in z) / (n - 1) / n) ** 0.5
    assert speedup_standard_error(mode, base) == pytest.approx(expected)
    assert speedup_standard_error(mode[:1], base[:1]) is None
