"""The quality gate: a candidate's score on the gate suite vs the champion's -> promote or not, and why.

The score comes from the evaluate stage's `metrics/eval.json` (eval/stage.py, eval/report.py):
`suites[<gate suite>]` holds `exact_match`, the share of prompts whose greedy spec output equals AR
token for token (None when sampled), and two τ of the draft's mode (Domino for a Domino draft;
`spec_mode` says which):
  - `walk[<mode>]`: the draft's τ at fixed K = B - 1 on the AR answers (eval.walk). It depends on
    the weights alone, so the gate uses it when present: metric "walk@K<k>";
  - `acceptance_length`: the engine's pooled τ, which under `num_draft: auto` moves with machine
    load through auto-K's choices (the same weights have measured far apart): metric "engine",
    the fallback for reports without the walk.

Rules, first match wins:
  1. exact match must be measured and exactly 1 (the draft must be lossless);
  2. no champion yet: promote;
  3. the champion was gated on another suite or another metric: not comparable, keep it (move
     the alias by hand);
  4. promote iff τ >= champion τ - tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dominospec.errors import UserError

ENGINE = "engine"


@dataclass(frozen=True)
class GateScore:
    """One draft on the gate suite."""

    suite: str
    acceptance_length: Optional[float]  # τ, pooled over the suite's prompts (bonus included)
    acceptance_length_se: Optional[float]  # its standard error over prompts
    exact_match: Optional[float]  # share of prompts equal to AR; None when sampled
    spec_mode: str  # "domino" | "dflash": the mode τ was measured in
    metric: str = ENGINE  # which τ: "walk@K<k>" (fixed-K walk) or "engine" (the engine's, auto-K)


@dataclass(frozen=True)
class ChampionScore:
    """The current champion, as its registry tags recorded it when it was gated."""

    version: str
    suite: str
    acceptance_length: float
    metric: str = ENGINE  # versions gated before the walk existed carry no metric tag: the engine's τ


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def read_score(report: dict[str, Any], suite: str) -> GateScore:
    """eval.json document + gate suite name -> the candidate's `GateScore`; UserError when the suite is absent."""
    suites = report.get("suites", {})
    if suite not in suites:
        raise UserError(f"retrain.gate_suite {suite!r} is not in the evaluation (suites: {sorted(suites)}, "
                        f"skipped as empty: {report.get('empty_suites', {})}); it must be one of evaluate.suites")
    entry, mode = suites[suite], str(report.get("spec_mode", "unknown"))
    walk = entry.get("walk") or {}
    if isinstance(walk.get(mode), dict):
        return GateScore(suite=suite, acceptance_length=walk[mode].get("acceptance_length"),
                         acceptance_length_se=walk[mode].get("acceptance_length_se"), exact_match=entry.get("exact_match"),
                         spec_mode=mode, metric=f"walk@K{walk.get('num_draft')}")
    return GateScore(suite=suite, acceptance_length=entry.get("acceptance_length"),
                     acceptance_length_se=entry.get("acceptance_length_se"),
                     exact_match=entry.get("exact_match"), spec_mode=mode)


def decide(candidate: GateScore, champion: Optional[ChampionScore], tolerance: float) -> Decision:
    """Candidate score (+ champion, tolerance) -> promote or not, with a one-line reason."""
    if candidate.exact_match is None:
        return Decision(False, f"exact match not measured on {candidate.suite} (evaluate.temperature > 0): "
                               "the gate needs greedy evaluation")
    if candidate.exact_match != 1.0:
        return Decision(False, f"exact match {candidate.exact_match:.4f} < 1 on {candidate.suite}: "
                               "spec output differs from AR (not lossless)")
    tau = candidate.acceptance_length
    if tau is None:
        return Decision(False, f"no τ on {candidate.suite} (no verify rounds)")
    if champion is None:
        return Decision(True, f"first version: no champion yet (gate τ {tau:.4f} on {candidate.suite}, {candidate.metric})")
    if champion.suite != candidate.suite:
        return Decision(False, f"champion version {champion.version} was gated on suite {champion.suite!r}, "
                               f"this candidate on {candidate.suite!r}: not comparable, move the alias by hand")
    if champion.metric != candidate.metric:
        return Decision(False, f"champion version {champion.version} was gated on τ {champion.metric!r}, this "
                               f"candidate on {candidate.metric!r}: not comparable, move the alias by hand")
    floor = champion.acceptance_length - tolerance
    verdict = ">=" if tau >= floor else "<"
    return Decision(tau >= floor, f"gate τ {tau:.4f} {verdict} champion version {champion.version} τ "
                                  f"{champion.acceptance_length:.4f} - tolerance {tolerance:g} = {floor:.4f} "
                                  f"on {candidate.suite} ({candidate.metric})")
