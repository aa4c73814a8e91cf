"""The train stage end to end on a tiny target: outputs, MLflow run, resume, crash recovery, DDP."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
from cache_helpers import save_regenerated, save_tiny_target, target_params, write_params  # noqa: E402

from dominospec.config import load_params  # noqa: E402
from dominospec.errors import UserError  # noqa: E402


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> Path:
    """A tiny Llama target, random conversations, and their hidden-state cache -> run root."""
    from dominospec.cache.stage import cache
    from dominospec.target import load_target

    root = tmp_path_factory.mktemp("train")
    target_dir = save_tiny_target(root / "target", "llama")
    identity = load_target(target_params(target_dir)).identity.as_dict()
    save_regenerated(root / "regenerated", identity, {"train": 48, "val": 12, "test": 2}, max_len=40)
    params_path = write_params(root / "params.yaml", target_dir, root, shard_tokens=512, num_feature_layers=3)
    cache(load_params(params_path))
    return root


def run_params(tiny_cache: Path, run: Path, **train) -> Path:
    """A params file training on `tiny_cache` with outputs under `run` and `train` overrides."""
    raw = yaml.safe_load((tiny_cache / "params.yaml").read_text())
    for key in ("checkpoints", "draft", "onnx", "metrics", "plots"):
        raw["paths"][key] = str(run / key)
    raw["draft"].update(block_size=4, gru_hidden_dim=16, emb_dim=8)
    raw["train"].update(
        dict(max_steps=6, batch_size=4, num_anchors=4, val_every_steps=3, checkpoint_every_steps=2,
             log_every_steps=1, val_max_sequences=8, precision="32-true", accelerator="cpu"),
        **train,
    )
    raw["mlflow"].update(tracking_uri=f"sqlite:///{run}/mlflow.db", artifact_location=str(run / "mlartifacts"))
    run.mkdir(parents=True, exist_ok=True)
    path = run / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def curve(run: Path) -> dict[int, float]:
    with open(run / "plots" / "train_curve.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def test_train_writes_checkpoints_metrics_plots_and_mlflow_run(tiny_cache, tmp_path):
    from dominospec.train.stage import train

    params = load_params(run_params(tiny_cache, tmp_path))
    torch.set_float32_matmul_precision("medium")
    try:
        train(params)
        assert torch.get_float32_matmul_precision() == "medium"  # its TF32 setting does not leak to what runs next
    finally:
        torch.set_float32_matmul_precision("highest")
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 6
    assert 0 < metrics["train_minutes"] < 5
    assert 1.0 <= metrics["val_acceptance_length"] <= 5.0
    assert len(metrics["val_accuracy_by_position"]) == 4 == len(metrics["val_accuracy_by_position_base"])
    assert sorted(curve(tmp_path)) == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "checkpoints" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "plots" / "val_accuracy_by_position.csv").is_file()

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=params.mlflow.tracking_uri)
    run_id = json.loads((tmp_path / "checkpoints" / "run.json").read_text())["mlflow_run_id"]
    run = client.get_run(run_id)
    for key in ("train/loss_base", "train/loss_final", "train/lambda", "train/lr", "val/acceptance_length",
                "val/acceptance_length_base", "val/accuracy_pos1"):
        assert key in run.data.metrics, key
    assert run.data.params["draft.block_size"] == "4"
    assert run.data.tags["dvc_stage"] == "train" and run.data.tags["git_commit"]
    lambdas = [m.value for m in client.get_metric_history(run_id, "train/lambda")]
    assert lambdas[0] == 1.0 and lambdas == sorted(lambdas, reverse=True) and lambdas[-1] < 0.2
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"train.json", "train_curve.png", "train_curve.csv"} <= artifacts


def test_loss_vocab_data_trains_only_the_supervised_tokens_head_rows(tiny_cache, tmp_path):
    """train.loss_vocab: data -> W2 rows of tokens the train split never supervises are exactly
    zero in the final draft (no correction for tokens it never learnt about); the others trained."""
    from safetensors.torch import load_file

    from dominospec.train.datamodule import PreparedSequences
    from dominospec.train.objective import loss_vocabulary
    from dominospec.train.stage import train

    train(load_params(run_params(tiny_cache, tmp_path, loss_vocab="data", labels="data")))
    vocab = loss_vocabulary(PreparedSequences(tiny_cache / "regenerated", "train"))
    w2 = load_file(str(tmp_path / "checkpoints" / "final" / "model.safetensors"))["embed_proj.2.weight"]  # [V, r]
    inside = torch.zeros(w2.shape[0], dtype=torch.bool)
    inside[vocab] = True
    assert 0 < vocab.numel() < w2.shape[0]
    assert not w2[~inside].any()
    assert w2[inside].abs().sum(-1).min() > 0
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 6 and metrics["val_walk_acceptance_length"] >= 1.0


def test_sampled_vocabulary_trains_through_the_stage_and_validates_on_the_full_vocabulary(tiny_cache, tmp_path):
    """train.loss_vocab: sampled -> the stage trains (the loss falls from its first steps) and its
    validation metrics are those of the full vocabulary; a sampled softmax with kd is refused."""
    from dominospec.train.stage import train

    train(load_params(run_params(tiny_cache, tmp_path, loss_vocab="sampled", loss_negatives=8, labels="target",
                                 max_steps=12, lr=3e-3)))
    losses = curve(tmp_path)
    steps = sorted(losses)
    assert sum(losses[s] for s in steps[-3:]) < sum(losses[s] for s in steps[:3])
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 12 and metrics["val_walk_acceptance_length"] >= 1.0 and metrics["val_loss"] > 0
    with pytest.raises(UserError, match="train.loss_vocab: sampled .* train.loss: kd"):
        train(load_params(run_params(tiny_cache, tmp_path / "kd", loss_vocab="sampled", loss="kd", features="online")))
    with pytest.raises(UserError, match="train.loss_negatives must be >= 1"):
        train(load_params(run_params(tiny_cache, tmp_path / "neg", loss_vocab="sampled", loss_negatives=0)))


def test_the_val_walk_covers_each_reply_to_val_walk_tokens(tiny_cache, tmp_path):
    """train.val_walk_tokens: each val reply is walked over its first n tokens only (evaluate decodes
    that many), so a short horizon walks fewer rounds; a horizon without a round is refused."""
    from dominospec.train.stage import train

    walks = {}
    for horizon in (None, 4):
        train(load_params(run_params(tiny_cache, tmp_path / str(horizon), max_steps=2, val_every_steps=2,
                                     val_walk_tokens=horizon)))
        walks[horizon] = json.loads((tmp_path / str(horizon) / "metrics" / "train.json").read_text())
    replies = walks[4]["val_walk_replies"]
    assert replies == walks[None]["val_walk_replies"] > 0
    assert replies <= walks[4]["val_walk_rounds"] <= 3 * replies  # 4 tokens: the first from the prefill, <= 3 rounds
    assert walks[None]["val_walk_rounds"] > 3 * replies  # the whole replies (up to 40 tokens) take more
    with pytest.raises(UserError, match="train.val_walk_tokens must be >= 2"):
        train(load_params(run_params(tiny_cache, tmp_path / "one", val_walk_tokens=1)))


def test_target_labels_refuse_the_loss_vocabulary(tiny_cache, tmp_path):
    """The loss vocabulary spans the data's assistant tokens; the target's labels can lie outside it."""
    from dominospec.train.stage import train

    with pytest.raises(UserError, match="train.loss_vocab: data .* train.labels: target"):
        train(load_params(run_params(tiny_cache, tmp_path, loss_vocab="data", labels="target")))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("softmax", [
    dict(loss_vocab="full"),
    dict(loss_vocab="sampled", loss_negatives=16),
    dict(group_by_length=True, features="online", labels="target"),
    dict(features="online", loss="tv", loss_vocab="full", val_walk_temperature=0.7),  # the acceptance loss
])
def test_resume_from_checkpoint_reproduces_the_next_steps(tiny_cache, tmp_path, softmax):
    """A resumed run's steps equal the uninterrupted run's, also with a sampled softmax (16 of the
    tiny vocabulary's 300 tokens a step: the set is drawn from a generator seeded by step), and with
    batches grouped by length from online features and the target's labels, and with the acceptance
    loss (train.loss: tv) on the online target's logits."""
    from dominospec.train.stage import train

    full = tmp_path / "full"
    train(load_params(run_params(tiny_cache, full, **softmax)))
    reference = curve(full)

    # A run that stopped right after its step-2 checkpoint: last.ckpt is that checkpoint.
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoints", resumed / "checkpoints")
    shutil.rmtree(resumed / "checkpoints" / "final")
    for later in ("step-000004.ckpt", "step-000006.ckpt"):
        (resumed / "checkpoints" / later).unlink()
    shutil.copy(resumed / "checkpoints" / "step-000002.ckpt", resumed / "checkpoints" / "last.ckpt")
    shutil.copy(full / "mlflow.db", resumed / "mlflow.db")
    train(load_params(run_params(tiny_cache, resumed, **softmax)))
    again = curve(resumed)
    # the resumed run's minutes include the part before the checkpoint it resumed from
    minutes = json.loads((resumed / "metrics" / "train.json").read_text())["train_minutes"]
    assert minutes > 0
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert again[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def test_changed_params_start_afresh(tiny_cache, tmp_path):
    from dominospec.train.stage import train

    train(load_params(run_params(tiny_cache, tmp_path, max_steps=2)))
    first = json.loads((tmp_path / "checkpoints" / "run.json").read_text())
    train(load_params(run_params(tiny_cache, tmp_path, max_steps=2, lr=1e-3)))
    second = json.loads((tmp_path / "checkpoints" / "run.json").read_text())
    assert first["fingerprint"] != second["fingerprint"]
    assert first["mlflow_run_id"] != second["mlflow_run_id"]
    assert sorted(curve(tmp_path)) == [1, 2]


def test_checkpoints_of_other_code_or_another_length_are_not_continued(tiny_cache, tmp_path, monkeypatch):
    """A finished run re-run as it was continues its checkpoints (nothing left to do); under other code
    (run.json's fingerprint holds the code digest) or with another max_steps (the cosine schedule
    spans max_steps, so a longer run is another run) it starts afresh and trains every step."""
    from dominospec.train import stage

    def run(max_steps: int) -> dict:
        stage.train(load_params(run_params(tiny_cache, tmp_path, max_steps=max_steps)))
        return json.loads((tmp_path / "checkpoints" / "run.json").read_text())

    first = run(2)
    assert run(2) == first
    longer = run(3)
    assert longer["fingerprint"] != first["fingerprint"] and longer["mlflow_run_id"] != first["mlflow_run_id"]
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"] == 3
    assert sorted(curve(tmp_path)) == [1, 2, 3]

    monkeypatch.setattr(stage, "code_digest", lambda: "other code")
    other_code = run(3)
    assert other_code["fingerprint"] != longer["fingerprint"] and other_code["mlflow_run_id"] != longer["mlflow_run_id"]
    assert sorted(curve(tmp_path)) == [1, 2, 3]


@pytest.mark.slow
def test_killed_training_resumes_when_rerun(tiny_cache, tmp_path):
    params = run_params(tiny_cache, tmp_path, max_steps=400, checkpoint_every_steps=5, val_every_steps=400)
    cmd = [sys.executable, str(REPO / "pipeline" / "train.py"), "--params", str(params)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = tmp_path / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (ckpts / "step-000010.ckpt").exists():
        assert proc.poll() is None, "training ended before it could be killed"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (ckpts / "final").exists()
    run_id = json.loads((ckpts / "run.json").read_text())["mlflow_run_id"]

    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Restoring states from the checkpoint" in done.stdout + done.stderr
    assert json.loads((ckpts / "run.json").read_text())["mlflow_run_id"] == run_id
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"] == 400
    steps = sorted(curve(tmp_path))
    assert steps[0] == 1 and steps[-1] == 400


@pytest.mark.slow
def test_ddp_two_cpu_processes(tiny_cache, tmp_path):
    params = run_params(tiny_cache, tmp_path, max_steps=4, strategy="ddp", devices=2, val_every_steps=4)
    cmd = [sys.executable, str(REPO / "pipeline" / "train.py"), "--params", str(params)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world_size: 2" in (done.stdout + done.stderr).replace("WORLD_SIZE", "world_size").lower() or \
        "distributed_backend=gloo" in done.stdout + done.stderr
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert metrics["steps"] == 4
    assert (tmp_path / "checkpoints" / "final" / "model.safetensors").is_file()
    # rank 1 starts once rank 0 has prepared the folder: it neither wipes it nor rewrites the run record
    assert json.loads((tmp_path / "checkpoints" / "run.json").read_text())["mlflow_run_id"]


def test_training_numerics_turn_off_cudnn_attention_and_restore_it():
    from dominospec.train.stage import training_numerics

    backends = torch.backends.cuda
    before = backends.cudnn_sdp_enabled()
    backends.enable_cudnn_sdp(True)
    try:
        with pytest.raises(RuntimeError):
            with training_numerics():
                assert not backends.cudnn_sdp_enabled()  # per-shape plans: off while training
                assert torch.get_float32_matmul_precision() == "high"
                raise RuntimeError("a failed step")
        assert backends.cudnn_sdp_enabled()  # restored, also after an error
    finally:
        backends.enable_cudnn_sdp(before)


def test_both_datasets_know_their_lengths_without_reading_features(tiny_cache):
    """train.group_by_length reads each sequence's length: from the cache's offsets, or the prepared ids."""
    from dominospec.cache.reader import CacheReader
    from dominospec.train.datamodule import CachedSequences, PreparedSequences

    raw = yaml.safe_load((tiny_cache / "params.yaml").read_text())
    cached = CachedSequences(CacheReader(raw["paths"]["cache"], "train"), limit=30)
    prepared = PreparedSequences(Path(raw["paths"]["regenerated"]), "train")
    assert cached.lengths() == [len(cached[i]["input_ids"]) for i in range(len(cached))]
    assert prepared.lengths() == [len(prepared[i]["input_ids"]) for i in range(len(prepared))]
    assert len(set(prepared.lengths())) > 1
