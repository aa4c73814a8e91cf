"""Training by the clock (train/timed.py): a stop at train.max_minutes; last.ckpt every train.checkpoint_minutes, so a process
killed outright (SIGKILL, a slice's time limit) resumes from it and ends with the weights of an
uninterrupted run; the val walk at train.walk_minutes lands in metrics/train_walk.json, the DVC
plot's CSV and MLflow, greedy and sampled."""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_preempt import REPO, ckpt_step, draft_weights, logged_step  # noqa: E402
from test_train_stage import run_params, tiny_cache  # noqa: E402,F401  (tiny_cache: a fixture)

from dominospec.config import load_params  # noqa: E402
from dominospec.train.stage import train  # noqa: E402
from dominospec.train.timed import WALK_COLUMNS, WalkClock  # noqa: E402

STEPS, NEVER = 150, 10_000


def mlflow_metric(run: Path, key: str) -> list[tuple[int, float]]:
    with sqlite3.connect(f"file:{run / 'mlflow.db'}?mode=ro", uri=True) as db:
        return db.execute("SELECT step, value FROM metrics WHERE key = ? ORDER BY step", (key,)).fetchall()


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_timed_checkpoint_as_an_uninterrupted_run(tiny_cache, tmp_path):
    common = dict(max_steps=STEPS, checkpoint_every_steps=NEVER, val_every_steps=STEPS)
    full = tmp_path / "full"
    train(load_params(run_params(tiny_cache, full, **common)))

    run = tmp_path / "killed"
    params = run_params(tiny_cache, run, checkpoint_minutes=0.005, **common)  # last.ckpt every 0.3 s
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(tmp_path / "killed.log", "w") as sink:
        proc = subprocess.Popen([sys.executable, str(REPO / "pipeline" / "train.py"), "--params", str(params)],
                                cwd=REPO, env=env, stdout=sink, stderr=sink)
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    while not (last.exists() and logged_step(run) >= 12):  # killed after a timed save, mid-run
        assert proc.poll() is None and time.time() < deadline, "training ended before the kill"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    stopped = ckpt_step(last)
    assert 1 <= stopped < STEPS and not (run / "metrics" / "train.json").exists()
    assert "minutes: saved step" in (tmp_path / "killed.log").read_text()

    train(load_params(params))
    assert json.loads((run / "metrics" / "train.json").read_text())["steps"] == STEPS
    reference, resumed = draft_weights(full), draft_weights(run)
    for name in reference:  # batches, anchors and schedule are functions of the step: bit for bit
        assert torch.equal(reference[name], resumed[name]), name


def test_the_walk_at_set_minutes_is_logged_greedy_and_sampled(tiny_cache, tmp_path):
    marks = [0.0001, 0.0002]  # passed within the first steps
    train(load_params(run_params(tiny_cache, tmp_path, walk_minutes=marks, val_walk_temperature=0.7)))
    doc = json.loads((tmp_path / "metrics" / "train_walk.json").read_text())
    assert [row["minutes"] for row in doc["rows"]] == marks
    for row in doc["rows"]:
        assert row["step"] >= 1 and row["sequences"] == row["step"] * 4
        assert 1.0 <= row["acceptance_length"] <= 4 and 1.0 <= row["acceptance_length_sampled"] <= 4
        assert row["acceptance_length_sampled"] != row["acceptance_length"]
    with open(tmp_path / "plots" / "train_walk.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == WALK_COLUMNS and len(list(reader)) == 2
    logged = mlflow_metric(tmp_path, "walk/acceptance_length_sampled")
    assert [step for step, _ in logged] == sorted({row["step"] for row in doc["rows"]})
    metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert 1.0 <= metrics["val_walk_acceptance_length_sampled"] <= 4  # the final validation's sampled walk too
    assert mlflow_metric(tmp_path, "val/walk_acceptance_length_sampled")


def test_the_time_budget_ends_training_with_its_final_outputs(tiny_cache, tmp_path):
    """train.max_minutes stops a run long before max_steps, and the stage still writes what a finished
    run writes (the final draft, train.json with the steps done)."""
    train(load_params(run_params(tiny_cache, tmp_path, max_steps=NEVER, val_every_steps=NEVER, max_minutes=0.002)))
    steps = json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"]
    assert 1 <= steps < NEVER
    assert (tmp_path / "checkpoints" / "final" / "model.safetensors").is_file()


def test_a_time_budget_that_is_not_positive_is_refused(tiny_cache, tmp_path):
    from dominospec.errors import UserError

    with pytest.raises(UserError, match="train.max_minutes must be > 0"):
        train(load_params(run_params(tiny_cache, tmp_path, max_minutes=0)))


def test_without_marks_the_files_hold_no_rows(tiny_cache, tmp_path):
    train(load_params(run_params(tiny_cache, tmp_path, max_steps=2, val_every_steps=2)))
    assert json.loads((tmp_path / "metrics" / "train_walk.json").read_text()) == {"rows": []}
    assert (tmp_path / "plots" / "train_walk.csv").read_text().strip() == ",".join(WALK_COLUMNS)
    assert "val_walk_acceptance_length_sampled" not in json.loads((tmp_path / "metrics" / "train.json").read_text())


def test_marks_passed_are_walked_once():
    clock = WalkClock([5, 10, 20], curves=None, metrics_dir=Path("."), plots_dir=Path("."))
    assert clock.pending(299) == [] and clock.pending(601) == [5, 10]
    clock.rows = [{"minutes": 5}]
    assert clock.pending(1300) == [10, 20]


def test_the_clock_keys_do_not_restart_a_run():
    """A slice may change when it saves and what it logs, or how the loss is computed: the run's
    fingerprint (what resumes) stays; a change of the loss does not."""
    import dataclasses

    from dominospec.train.stage import run_fingerprint

    params = load_params(REPO / "params.yaml")
    clock = dataclasses.replace(params.train, checkpoint_minutes=2.0, walk_minutes=[5.0, 10.0], val_walk_temperature=0.7,
                                max_minutes=12.0)
    loss = dataclasses.replace(params.train, loss="tv")
    kernels = dataclasses.replace(params.train, ce_kernel="torch", distill_kernel="rows")  # the same loss, computed otherwise
    assert run_fingerprint(dataclasses.replace(params, train=clock), "d") == run_fingerprint(params, "d")
    assert run_fingerprint(dataclasses.replace(params, train=kernels), "d") == run_fingerprint(params, "d")
    assert run_fingerprint(dataclasses.replace(params, train=loss), "d") != run_fingerprint(params, "d")


def test_a_run_the_clock_stops_ends_with_its_schedules_run_down(tiny_cache, tmp_path):
    """With train.max_minutes far short of max_steps, the LR's warm-up and cosine and the lambda
    curriculum follow the budget spent: the LR peaks and falls back, and lambda reaches 0, where on
    steps alone (a few of 10,000) the LR would still be warming up and lambda near 1."""
    import yaml

    params = run_params(tiny_cache, tmp_path, max_steps=NEVER, val_every_steps=NEVER, max_minutes=0.05,
                        warmup_fraction=0.1, lambda_decay_fraction=0.5)
    train(load_params(params))
    lr = yaml.safe_load(params.read_text())["train"]["lr"]
    with open(tmp_path / "plots" / "train_curve.csv") as f:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    steps = json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"]
    assert 10 <= steps < NEVER and len(rows) >= 10
    lrs = [r["lr"] for r in rows]
    assert max(lrs) >= 0.9 * lr  # warmed up on the clock (on steps: at most steps / 1,000 of lr)
    assert lrs[-1] <= 0.35 * lr and lrs[-1] < max(lrs)  # and decayed: the last step is in the cosine's last fifth
    assert rows[-1]["lambda"] == 0.0 and rows[0]["lambda"] > 0.5


@pytest.mark.slow
def test_under_ddp_every_rank_stops_at_the_clock_s_step(tiny_cache, tmp_path):
    """Two CPU ranks (gloo) read one clock, reduced a step: both stop at the same step, or the first
    to stop would leave the other waiting in its gradient all-reduce until the timeout."""
    params = run_params(tiny_cache, tmp_path, max_steps=NEVER, val_every_steps=NEVER, max_minutes=0.01,
                        strategy="ddp", devices=2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(REPO / "pipeline" / "train.py"), "--params", str(params)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 1 <= json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"] < NEVER
