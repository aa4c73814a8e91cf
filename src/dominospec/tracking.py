"""MLflow bookkeeping shared by the stages: one tracking URI, tags, flattened params, figures.

Every component logs to `params.mlflow.tracking_uri` (default `sqlite:///mlflow.db`) with
artifacts under `params.mlflow.artifact_location` (default `mlartifacts/`), so `make ui`, the
Lightning logger and the evaluation runs all see the same store.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Optional

from dominospec.config import Params, as_flat_dict


def git_commit() -> str:
    """HEAD commit of the working tree, with '+dirty' when there are uncommitted changes; 'unknown' outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return sha + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_tags(stage: str) -> dict[str, str]:
    """Tags that tie an MLflow run to the code and the DVC stage that made it."""
    return {
        "git_commit": git_commit(),
        "dvc_stage": stage,
        "dvc_exp": os.environ.get("DVC_EXP_NAME", ""),
    }


def artifact_uri(params: Params) -> str:
    """Absolute file URI of the artifact root (MLflow wants a URI, params hold a relative path)."""
    return Path(params.mlflow.artifact_location).resolve().as_uri()


def ensure_experiment(params: Params) -> str:
    """Create (once) or fetch the experiment; returns its id."""
    import mlflow

    mlflow.set_tracking_uri(params.mlflow.tracking_uri)
    exp = mlflow.get_experiment_by_name(params.mlflow.experiment)
    if exp is not None:
        return exp.experiment_id
    return mlflow.create_experiment(params.mlflow.experiment, artifact_location=artifact_uri(params))


def flat_params(params: Params) -> dict[str, Any]:
    """Flattened params as MLflow accepts them (values as strings, None as 'null')."""
    return {k: ("null" if v is None else v) for k, v in as_flat_dict(params).items()}


def lightning_logger(params: Params, stage: str, run_id: Optional[str] = None) -> Any:
    """Lightning's MLFlowLogger on the project store; `run_id` resumes an existing run."""
    from lightning.pytorch.loggers import MLFlowLogger

    ensure_experiment(params)
    return MLFlowLogger(
        experiment_name=params.mlflow.experiment,
        run_name=stage,
        tracking_uri=params.mlflow.tracking_uri,
        artifact_location=artifact_uri(params),
        tags=run_tags(stage),
        run_id=run_id,
        log_model=False,
    )
