"""`make serve` serves the registry's champion when there is one, and says which version."""

import dataclasses
import hashlib
from pathlib import Path

from dominospec.retrain.job import retrain
from dominospec.cli import with_champion


def test_serve_picks_the_champion(workspace, registry, capsys):
    workspace.candidate(tau=1.40)
    retrain(workspace.params())
    workspace.candidate(tau=1.10)  # rejected: the export dir now holds a draft that is not the champion
    assert retrain(workspace.params())["decision"] == "rejected"
    capsys.readouterr()
    served = with_champion(workspace.params())
    assert "serving dominospec-draft version 1 (champion)" in capsys.readouterr().out
    weights = (Path(served.paths.draft) / "model.safetensors").read_bytes()  # the registered copy, not the export
    champion_sha = registry.client.get_model_version("dominospec-draft", "1").tags["draft_sha256"]
    assert hashlib.sha256(weights).hexdigest() == champion_sha
    export_sha = hashlib.sha256((workspace.root / "artifacts/draft/model.safetensors").read_bytes()).hexdigest()
    assert export_sha != champion_sha


def test_without_a_registry_serve_keeps_paths_draft_and_creates_no_store(workspace, capsys):
    params = workspace.params()
    params = dataclasses.replace(params, mlflow=dataclasses.replace(
        params.mlflow, tracking_uri=f"sqlite:///{workspace.root / 'absent.db'}"))
    assert with_champion(params) == params
    assert "serving artifacts/draft (no champion" in capsys.readouterr().out
    assert not (workspace.root / "absent.db").exists()


def test_a_store_without_the_model_keeps_paths_draft(workspace):
    params = workspace.params()
    assert with_champion(params) == params
