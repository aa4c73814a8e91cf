"""A retrain workspace per test: params whose pipeline is fake_pipeline.py, and a real MLflow sqlite store.

The store is created (migrated) once per session and copied into each test's tmp_path, which saves
the ~4 s of schema migrations per test. The tracking URI is absolute (MLflow caches stores by URI).
"""

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from dominospec.config import Params, load_params

REPO = Path(__file__).resolve().parents[2]
FAKE_PIPELINE = Path(__file__).with_name("fake_pipeline.py")


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}").search_experiments()
    return db


@dataclass
class Workspace:
    root: Path
    params_path: Path

    def params(self) -> Params:
        return load_params(self.params_path)

    def candidate(self, tau: float = 1.3, exact_match: float = 1.0, action: str = "ok") -> None:
        """What the next fake pipeline run produces."""
        (self.root / "candidate.json").write_text(json.dumps({"tau": tau, "exact_match": exact_match,
                                                              "action": action}))

    def cli(self, **popen) -> subprocess.Popen:
        """`dominospec retrain` as a real process (own session, so a test can kill its whole group)."""
        return subprocess.Popen([sys.executable, "-m", "dominospec.cli", "retrain", "--params", str(self.params_path)],
                                cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, **popen)

    def report(self) -> dict:
        return json.loads((self.root / "metrics" / "retrain.json").read_text())


@pytest.fixture
def workspace(tmp_path, monkeypatch, empty_store) -> Workspace:
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["mlflow"].update(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location="mlartifacts")
    raw["evaluate"].update(suites=["sharegpt", "humaneval"], temperature=0.0)
    raw["retrain"].update(registered_model="dominospec-draft", gate_suite="sharegpt", tolerance=0.05,
                          lock_file=".retrain.lock",
                          commands=[[sys.executable, str(FAKE_PIPELINE), "--params", "params.yaml"]])
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    monkeypatch.chdir(tmp_path)
    return Workspace(tmp_path, params_path)


@pytest.fixture
def registry(workspace):
    from dominospec.retrain.registry import Registry

    return Registry(workspace.params())
