"""The gate against a real MLflow registry (sqlite): who becomes champion, who does not, and why."""

import dataclasses
import hashlib

import pytest

from dominospec.cli import main
from dominospec.errors import UserError
from dominospec.retrain.gate import ChampionScore, GateScore, decide
from dominospec.retrain.job import retrain


def score(tau, exact=1.0, suite="sharegpt"):
    return GateScore(suite, tau, 0.02, exact, "domino")


@pytest.mark.parametrize("candidate, champion, promote, reason", [
    (score(1.2), None, True, "first version"),
    (score(1.45), ChampionScore("1", "sharegpt", 1.30), True, "1.4500 >= champion version 1 τ 1.3000"),
    (score(1.26), ChampionScore("1", "sharegpt", 1.30), True, ">= champion"),  # within the tolerance 0.05
    (score(1.24), ChampionScore("1", "sharegpt", 1.30), False, "1.2400 < champion version 1 τ 1.3000 - tolerance 0.05"),
    (score(2.0, exact=0.9375), ChampionScore("1", "sharegpt", 1.30), False, "exact match 0.9375 < 1"),
    (score(2.0, exact=0.9375), None, False, "exact match 0.9375 < 1"),  # not even a first champion
    (score(2.0, exact=None), None, False, "exact match not measured"),
    (score(2.0, suite="humaneval"), ChampionScore("1", "sharegpt", 1.30), False, "not comparable"),
    (dataclasses.replace(score(2.0), metric="walk@K7"), ChampionScore("1", "sharegpt", 1.30), False,
     "gated on τ 'engine', this candidate on 'walk@K7': not comparable"),
    (dataclasses.replace(score(1.31), metric="walk@K7"), ChampionScore("1", "sharegpt", 1.30, "walk@K7"), True,
     "1.3100 >= champion version 1 τ 1.3000 - tolerance 0.05 = 1.2500 on sharegpt (walk@K7)"),
])
def test_decide(candidate, champion, promote, reason):
    decision = decide(candidate, champion, tolerance=0.05)
    assert decision.promote is promote
    assert reason in decision.reason


def test_the_gate_reads_the_fixed_k_walk_when_the_evaluation_has_it():
    """The walk τ (weights only) wins over the engine's auto-K τ (load-dependent); old reports fall back."""
    from dominospec.retrain.gate import read_score

    entry = {"acceptance_length": 1.10, "acceptance_length_se": 0.05, "exact_match": 1.0}
    walk = {"num_draft": 7, "domino": {"acceptance_length": 1.62, "acceptance_length_se": 0.04},
            "dflash": {"acceptance_length": 1.50, "acceptance_length_se": 0.04}}
    with_walk = read_score({"spec_mode": "domino", "suites": {"sharegpt": {**entry, "walk": walk}}}, "sharegpt")
    assert (with_walk.acceptance_length, with_walk.acceptance_length_se, with_walk.metric) == (1.62, 0.04, "walk@K7")
    head_off = read_score({"spec_mode": "dflash", "suites": {"sharegpt": {**entry, "walk": walk}}}, "sharegpt")
    assert head_off.acceptance_length == 1.50
    old = read_score({"spec_mode": "domino", "suites": {"sharegpt": entry}}, "sharegpt")
    assert (old.acceptance_length, old.metric) == (1.10, "engine")


def test_first_version_becomes_champion_with_its_tags(workspace, registry):
    workspace.candidate(tau=1.30)
    report = retrain(workspace.params())
    assert report["decision"] == "promoted" and report["version"] == "1" and report["champion_before"] is None
    assert registry.champion_version() == "1"
    tags = registry.client.get_model_version("dominospec-draft", "1").tags
    assert tags["gate.decision"] == "promoted" and "first version" in tags["gate.reason"]
    assert float(tags["gate.acceptance_length"]) == 1.30 and float(tags["gate.exact_match"]) == 1.0
    assert tags["gate.metric"] == "walk@K7"  # the fixed-K walk, not the engine's auto-K τ (1.0 here)
    assert float(tags["eval.sharegpt.acceptance_length"]) == 1.0
    assert float(tags["eval.sharegpt.walk_domino"]) == 1.30
    assert float(tags["eval.humaneval.walk_domino"]) == pytest.approx(1.20)
    assert tags["dvc_lock_sha256"] == hashlib.sha256((workspace.root / "dvc.lock").read_bytes()).hexdigest()
    assert tags["draft_sha256"] == hashlib.sha256((workspace.root / "artifacts/draft/model.safetensors")
                                                  .read_bytes()).hexdigest()
    assert tags["git_commit"]  # 'unknown' here: the workspace is no git checkout
    run = registry.client.get_run(report["mlflow_run_id"])
    assert run.data.metrics["sharegpt/walk_domino"] == 1.30 and run.data.metrics["sharegpt/acceptance_length"] == 1.0
    assert workspace.report()["decision"] == "promoted"


def test_better_candidate_is_promoted(workspace, registry):
    workspace.candidate(tau=1.30)
    retrain(workspace.params())
    workspace.candidate(tau=1.45)
    report = retrain(workspace.params())
    assert report["decision"] == "promoted" and report["champion_before"] == "1"
    assert registry.champion_version() == "2"


def test_worse_candidate_is_not_promoted_and_says_why(workspace, registry, capsys):
    workspace.candidate(tau=1.40)
    assert main(["retrain", "--params", str(workspace.params_path)]) == 0
    workspace.candidate(tau=1.20)  # 0.20 below the champion, tolerance 0.05
    assert main(["retrain", "--params", str(workspace.params_path)]) == 1
    assert registry.champion_version() == "1"
    why = "gate τ 1.2000 < champion version 1 τ 1.4000 - tolerance 0.05 = 1.3500 on sharegpt (walk@K7)"
    tags = registry.client.get_model_version("dominospec-draft", "2").tags
    assert tags["gate.decision"] == "rejected" and tags["gate.reason"] == why
    report = workspace.report()
    assert report["decision"] == "rejected" and report["reason"] == why
    assert report["version"] == "2" and report["champion"] == "1"
    assert "version 2 NOT promoted, champion stays version 1" in capsys.readouterr().out


def test_exact_match_failure_is_not_promoted(workspace, registry):
    workspace.candidate(tau=1.30)
    retrain(workspace.params())
    workspace.candidate(tau=2.50, exact_match=0.9375)  # far better τ, but not lossless
    report = retrain(workspace.params())
    assert report["decision"] == "rejected" and "exact match 0.9375 < 1" in report["reason"]
    assert registry.champion_version() == "1"


def test_params_the_gate_cannot_judge_are_refused_before_any_work(workspace, registry):
    params = workspace.params()
    sampled = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, temperature=0.7))
    with pytest.raises(UserError, match="evaluate.temperature"):
        retrain(sampled)
    assert not (workspace.root / "artifacts").exists()  # the pipeline never ran
