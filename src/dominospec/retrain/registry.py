"""The MLflow registered model `retrain.registered_model`: its versions, their gate tags, the `champion` alias.

A retrain logs one MLflow run ("retrain": the draft dir and eval.json as artifacts, the eval metrics)
and registers the run's `draft/` artifact as a new version. Version tags:

  gate.decision      pending -> promoted | rejected (a version left `pending` belongs to a retrain
                     that died between registering and deciding; it never became champion)
  gate.reason        the gate's one-line reason
  gate.suite, gate.metric, gate.acceptance_length, gate.acceptance_length_se, gate.exact_match,
  gate.spec_mode, gate.tolerance, gate.champion_before
  eval.<suite>.<key> the evaluation's headline metrics, every suite
  git_commit, dvc_lock_sha256, draft_sha256

Invariant: the alias `champion` is only ever set by `promote`, the last step of a retrain that
passed the gate; nothing else here writes it, so a failed or killed retrain leaves it untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dominospec.config import Params
from dominospec.errors import UserError
from dominospec.retrain.gate import ENGINE, ChampionScore, Decision, GateScore

CHAMPION = "champion"
PENDING, PROMOTED, REJECTED = "pending", "promoted", "rejected"
EVAL_KEYS = ("acceptance_length", "acceptance_length_se", "acceptance_length_no_head", "acceptance_length_ngram",
             "exact_match", "speedup", "n_prompts")  # per suite: tagged on the version, logged on the run


@dataclass(frozen=True)
class ChampionDraft:
    """The champion's draft, downloaded (or, on a local artifact store, in place)."""

    model: str
    version: str
    path: Path


def eval_metrics(report: dict[str, Any]) -> dict[str, float]:
    """eval.json document -> {"<suite>/<key>": value} for the numeric headline metrics of every suite,
    the fixed-K walk's τ of each mode as "<suite>/walk_<mode>"."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    out = {}
    for suite, entry in report["suites"].items():
        out.update({f"{suite}/{key}": float(entry[key]) for key in EVAL_KEYS if number(entry.get(key))})
        walk = entry.get("walk") or {}
        out.update({f"{suite}/walk_{mode}": float(w["acceptance_length"]) for mode, w in walk.items()
                    if isinstance(w, dict) and number(w.get("acceptance_length"))})
    return out


def gate_tags(score: GateScore, tolerance: float) -> dict[str, str]:
    """Candidate's gate score -> its `gate.*` version tags (decision still pending)."""
    return {"gate.decision": PENDING, "gate.suite": score.suite, "gate.acceptance_length": str(score.acceptance_length),
            "gate.acceptance_length_se": str(score.acceptance_length_se), "gate.exact_match": str(score.exact_match),
            "gate.spec_mode": score.spec_mode, "gate.metric": score.metric, "gate.tolerance": str(tolerance)}


class Registry:
    """The registered model of `params.retrain` in the store of `params.mlflow`."""

    def __init__(self, params: Params):
        from mlflow import MlflowClient

        self.params = params
        self.name = params.retrain.registered_model
        uri = params.mlflow.tracking_uri
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    def champion_version(self) -> Optional[str]:
        """-> the version the alias `champion` points at, None when there is no model or no champion."""
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(self.name)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        version = model.aliases.get(CHAMPION)  # an int in MLflow 3; versions are strings everywhere here
        return None if version is None else str(version)

    def champion_score(self) -> Optional[ChampionScore]:
        """-> the champion's gate score from its tags; UserError when the champion carries none."""
        version = self.champion_version()
        if version is None:
            return None
        tags = self.client.get_model_version(self.name, version).tags
        try:
            return ChampionScore(version, tags["gate.suite"], float(tags["gate.acceptance_length"]),
                                 tags.get("gate.metric", ENGINE))
        except (KeyError, ValueError):
            raise UserError(f"{self.name} version {version} is champion but has no gate.suite / gate.acceptance_length "
                            "tags (set by hand?): tag it, or move the alias to a gated version") from None

    def log_candidate(self, draft: Path, eval_json: Path, report: dict[str, Any],
                      tags: dict[str, str]) -> tuple[str, str]:
        """Draft dir + eval.json -> one finished MLflow run holding both; returns (run id, draft artifact URI)."""
        from dominospec.tracking import artifact_uri

        experiment = self.client.get_experiment_by_name(self.params.mlflow.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None else
                         self.client.create_experiment(self.params.mlflow.experiment,
                                                       artifact_location=artifact_uri(self.params)))
        run = self.client.create_run(experiment_id, run_name="retrain", tags=tags)
        run_id = run.info.run_id
        for key, value in eval_metrics(report).items():
            self.client.log_metric(run_id, key, value)
        self.client.log_artifacts(run_id, str(draft), "draft")
        self.client.log_artifact(run_id, str(eval_json))
        self.client.set_terminated(run_id)
        return run_id, f"{run.info.artifact_uri}/draft"

    def register(self, run_id: str, source: str, tags: dict[str, str]) -> str:
        """A logged draft -> a new version (the model is created on first use); returns the version."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(
                self.name, description="Domino drafts registered by `dominospec retrain`; alias `champion` = served")
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        return str(self.client.create_model_version(self.name, source, run_id=run_id, tags=tags).version)

    def record(self, version: str, decision: Decision) -> None:
        """The gate's decision and reason -> the version's tags."""
        outcome = PROMOTED if decision.promote else REJECTED
        self.client.set_model_version_tag(self.name, version, "gate.decision", outcome)
        self.client.set_model_version_tag(self.name, version, "gate.reason", decision.reason)

    def promote(self, version: str) -> None:
        """Move the alias `champion` to `version` (the only writer of the alias)."""
        self.client.set_registered_model_alias(self.name, CHAMPION, version)

    def champion_draft(self) -> Optional[ChampionDraft]:
        """-> the champion's draft dir on local disk, None without a champion."""
        import mlflow

        version = self.champion_version()
        if version is None:
            return None
        source = self.client.get_model_version(self.name, version).source
        # A local artifact store returns the path in place; a remote one downloads to a temp dir.
        path = mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=self.params.mlflow.tracking_uri)
        return ChampionDraft(self.name, version, Path(path))


def store_exists(params: Params) -> bool:
    """Whether the tracking store may hold a registry: False for a sqlite file that is not there (so that
    looking does not create one); True for any other URI."""
    uri = params.mlflow.tracking_uri
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).is_file()
    return True


def champion_draft(params: Params) -> Optional[ChampionDraft]:
    """Params -> the registered champion's draft, None when there is no store, model or champion."""
    if not store_exists(params):
        return None
    return Registry(params).champion_draft()
