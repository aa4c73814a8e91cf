"""A SIGTERM mid-training: last.ckpt at the step it came in, exit 143, no final outputs; the rerun
finishes the run with the weights of an uninterrupted one. Other errors save nothing."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
from test_train_stage import curve, run_params, tiny_cache  # noqa: E402,F401  (tiny_cache: a fixture)

from dominospec.config import load_params  # noqa: E402
from dominospec.train.preempt import SIGTERM_EXIT  # noqa: E402
from dominospec.train.stage import train  # noqa: E402

STEPS = 120  # ~45 steps/s here: seconds between the third step and the end for the signal to land
NEVER = 10_000  # checkpoint_every_steps: no periodic checkpoint before the signal


def logged_step(run: Path) -> int:
    """Last step of train/loss in the run's MLflow store (Lightning logs every step, synchronously)."""
    try:
        with sqlite3.connect(f"file:{run / 'mlflow.db'}?mode=ro", uri=True) as db:
            return db.execute("SELECT MAX(step) FROM metrics WHERE key = 'train/loss'").fetchone()[0] or 0
    except sqlite3.OperationalError:  # no store or no table yet
        return 0


def ckpt_step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def draft_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / "final" / "model.safetensors"))


def assert_no_final_outputs(run: Path) -> None:
    assert not (run / "metrics" / "train.json").exists()
    assert not (run / "checkpoints" / "final").exists()
    assert not (run / "checkpoints" / "last.ckpt.tmp").exists()


@pytest.mark.slow
def test_sigterm_saves_its_step_and_the_rerun_ends_as_an_uninterrupted_run(tiny_cache, tmp_path):
    full = tmp_path / "full"
    train(load_params(run_params(tiny_cache, full, max_steps=STEPS, checkpoint_every_steps=NEVER,
                                 val_every_steps=STEPS)))

    run = tmp_path / "preempted"
    params = run_params(tiny_cache, run, max_steps=STEPS, checkpoint_every_steps=NEVER, val_every_steps=STEPS)
    cmd = [sys.executable, str(REPO / "pipeline" / "train.py"), "--params", str(params)]  # what dvc runs
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # one thread, as in this process
    log = tmp_path / "preempted.log"  # a file, not a pipe: nobody reads a pipe while it trains
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=sink)
    deadline = time.time() + 120
    while logged_step(run) < 3:
        assert proc.poll() is None and time.time() < deadline, "training ended before the signal"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    out = log.read_text()
    assert proc.returncode == SIGTERM_EXIT, out[-3000:]

    last = run / "checkpoints" / "last.ckpt"
    stopped = ckpt_step(last)
    assert 3 <= stopped < STEPS, "the signal came after training ended"
    assert f"SIGTERM: saved step {stopped} to {last}" in out
    assert sorted(p.name for p in last.parent.glob("*.ckpt")) == ["last.ckpt"]  # no periodic one
    assert_no_final_outputs(run)

    train(load_params(params))
    metrics = json.loads((run / "metrics" / "train.json").read_text())
    assert metrics["steps"] == STEPS
    assert sorted(curve(run)) == list(range(1, STEPS + 1))  # every step once: the rerun began at stopped + 1
    assert sorted(p.name for p in last.parent.glob("*.ckpt")) == ["last.ckpt"]  # the next resume's, not last-v1
    reference, resumed = draft_weights(full), draft_weights(run)
    assert reference.keys() == resumed.keys()
    for name in reference:  # batches, sampling and schedule are functions of the step: bit for bit
        assert torch.equal(reference[name], resumed[name]), name


class Sigterm(L.Callback):
    """Sends this process a real SIGTERM, once, from the Lightning hook `hook` during trainer.`fn`
    at global step `step`."""

    def __init__(self, hook: str, fn: str, step: int) -> None:
        self.fn, self.step, self.sent = fn, step, False
        setattr(self, hook, self.send)

    def send(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.state.fn == self.fn and trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def uninterrupted(tiny_cache, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final draft weights of the 6-step run, trained without a stop."""
    run = tmp_path_factory.mktemp("uninterrupted")
    train(load_params(run_params(tiny_cache, run, checkpoint_every_steps=NEVER)))
    return draft_weights(run)


# 6 steps, validation after steps 3 and 6 (two batches each), then the stage's trainer.validate.
@pytest.mark.parametrize("hook, fn, step", [
    ("on_train_batch_end", "fit", 6),  # the last step: Lightning raises in its validation
    ("on_validation_batch_end", "fit", 3),  # mid-validation inside fit: the evaluation loop raises
    ("on_train_end", "fit", 6),  # after the loops' last check: the stage's check after fit
    ("on_validation_batch_end", "validate", 6),  # mid trainer.validate: raises, the callback saves
    ("on_validation_end", "validate", 6),  # after its last batch: the stage's check after validate
])
def test_sigterm_anywhere_saves_its_step_and_the_rerun_completes_the_run(tiny_cache, tmp_path, uninterrupted,
                                                                         hook, fn, step):
    params = load_params(run_params(tiny_cache, tmp_path, checkpoint_every_steps=NEVER))
    with pytest.raises(SystemExit) as stop:
        train(params, callbacks=[Sigterm(hook, fn, step)])
    assert stop.value.code == SIGTERM_EXIT
    assert ckpt_step(tmp_path / "checkpoints" / "last.ckpt") == step
    assert_no_final_outputs(tmp_path)

    train(params)
    assert json.loads((tmp_path / "metrics" / "train.json").read_text())["steps"] == 6
    assert sorted(curve(tmp_path)) == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")) == ["last.ckpt"]
    resumed = draft_weights(tmp_path)
    assert all(torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted)


class FailAt(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        if trainer.global_step == 3:
            raise RuntimeError("a broken step")


def test_other_errors_save_no_checkpoint(tiny_cache, tmp_path):
    params = load_params(run_params(tiny_cache, tmp_path, checkpoint_every_steps=NEVER))
    with pytest.raises(RuntimeError, match="a broken step"):
        train(params, callbacks=[FailAt()])
    assert not list((tmp_path / "checkpoints").glob("*.ckpt*"))
    assert_no_final_outputs(tmp_path)


def test_training_minutes_stop_at_the_end_of_training():
    """A checkpoint saved after training ended (a SIGTERM in the final validation) must not count the
    time since as optimisation: CurveRecorder's clock stops at on_train_end."""
    from dominospec.train.curves import CurveRecorder

    recorder = CurveRecorder()
    recorder.on_train_start(None, None)
    time.sleep(0.02)
    recorder.on_train_end(None, None)
    trained = recorder.train_seconds
    assert trained >= 0.02
    time.sleep(0.05)
    assert recorder.state_dict()["train_seconds"] == trained
