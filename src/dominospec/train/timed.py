"""What training does by the clock: a checkpoint every few minutes, the val walk at set minutes, a stop.

A GPU run is driven in slices of <= 10 minutes (benchmarks/gpu_recipe.py): a slice killed by its
time limit resumes from last.ckpt, so what it loses is the work since the last save. Steps make a
poor clock for that (a step's time varies by preset and card), hence `TimedCheckpoint`: last.ckpt
every `train.checkpoint_minutes` of this process's training wall time, written atomically
(preempt.save_last). It subclasses Lightning's Checkpoint so it runs after every other callback
of a step (CurveRecorder's row and the walk below are in the state it saves).

`WalkClock` walks the val replies (greedy, and sampled at train.val_walk_temperature: the module's
`walk_batch`) when the training wall time (CurveRecorder's clock, which a resumed run continues)
first passes each of `train.walk_minutes`, and keeps one row per mark: minutes, step, sequences
seen, τ head on / off, greedy / sampled. The rows go to MLflow (`walk/*` at the step), to
metrics/train_walk.json and plots/train_walk.csv (written as each row comes, so a killed slice
keeps them). Its marks and rows are checkpoint state: a run that resumes before a mark's row was
saved walks that mark again, at the resumed clock. The walk draws nothing at random, so it leaves
the training's random state as it was. Under DDP each rank walks its own stride of the val split
and the row is rank 0's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint

from dominospec.files import write_json
from dominospec.train.curves import CurveRecorder, write_csv
from dominospec.train.preempt import save_last

WALK_COLUMNS = ("minutes", "train_minutes", "step", "sequences", "acceptance_length", "acceptance_length_se",
                "acceptance_length_base", "acceptance_length_sampled", "acceptance_length_sampled_se",
                "acceptance_length_base_sampled")


class TimedCheckpoint(Checkpoint):
    """last.ckpt (atomic) every `minutes` of this process's training wall time, after a step."""

    def __init__(self, ckpt_dir: Path, minutes: float) -> None:
        self.ckpt_dir, self.seconds = ckpt_dir, 60.0 * minutes
        self._last: Optional[float] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None and now - self._last >= self.seconds:
            save_last(trainer, self.ckpt_dir, reason=f"{self.seconds / 60:g} minutes")
            self._last = time.perf_counter()


class TimeBudget(L.Callback):
    """Ends training once its wall time (CurveRecorder's clock, continued by a resumed run) reaches
    `minutes`: the run finishes as at max_steps (final outputs written). The fraction spent drives the
    module's schedules (`DraftLitModule.schedule_step`), so the LR and the curriculum are run down by
    the end whichever of the two stops the run. The clock is reduced (max over ranks) once a step, so
    every rank reads the same fraction and stops at the same step."""

    def __init__(self, minutes: float, curves: CurveRecorder) -> None:
        self.seconds, self.curves = 60.0 * minutes, curves
        self.spent_seconds = 0.0

    def fraction(self) -> float:
        """The budget spent at the last step's end, in [0, 1]."""
        return min(1.0, self.spent_seconds / self.seconds)

    def _tick(self, trainer: L.Trainer) -> None:
        elapsed = self.curves.elapsed()
        if trainer.world_size > 1:  # one process reads its own clock: no device round trip a step
            clock = torch.tensor(elapsed, dtype=torch.float64, device=trainer.strategy.root_device)
            elapsed = float(trainer.strategy.reduce(clock, reduce_op="max"))
        self.spent_seconds = elapsed

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._tick(trainer)  # a resumed run's schedule starts where its clock stood
        pl_module.budget_spent = self.fraction

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._tick(trainer)
        if self.spent_seconds >= self.seconds:
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.budget_spent = None


class WalkClock(L.Callback):
    """The val walk when the training wall time passes each of `minutes` -> rows (module docstring)."""

    def __init__(self, minutes: list[float], curves: CurveRecorder, metrics_dir: Path, plots_dir: Path) -> None:
        self.minutes, self.curves = sorted(minutes), curves
        self.metrics_path, self.csv_path = metrics_dir / "train_walk.json", plots_dir / "train_walk.csv"
        self.rows: list[dict[str, Any]] = []

    def pending(self, elapsed_s: float) -> list[float]:
        """Marks passed at `elapsed_s` seconds of training with no row yet."""
        done = {row["minutes"] for row in self.rows}
        return [m for m in self.minutes if m not in done and elapsed_s >= 60.0 * m]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        marks = self.pending(self.curves.elapsed())
        if not marks:
            return
        row = self.walk(trainer, pl_module)
        for mark in marks:  # a step that passed several marks at once counts for each
            self.rows.append({"minutes": mark, **row})
        if trainer.logger is not None:
            trainer.logger.log_metrics({f"walk/{k}": float(v) for k, v in row.items() if v is not None},
                                       step=trainer.global_step)
        if trainer.is_global_zero:
            self.write()

    @torch.no_grad()
    def walk(self, trainer: L.Trainer, pl_module: Any) -> dict[str, Any]:
        """The val split walked now -> the row's values (τ head on / off, greedy / sampled)."""
        from dominospec.train.module import empty_walks

        walks = empty_walks()
        was_training = pl_module.training
        pl_module.eval()
        try:
            with trainer.precision_plugin.forward_context():
                for batch in trainer.datamodule.val_dataloader():
                    batch = {k: v.to(pl_module.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    for key, stats in pl_module.walk_batch(batch).items():
                        walks[key].merge(stats)
        finally:
            pl_module.train(was_training)
        tau = lambda key: walks[key].acceptance_length if walks[key].rounds else None  # noqa: E731
        se = lambda key: walks[key].standard_error() if walks[key].rounds else None  # noqa: E731
        return {
            "train_minutes": round(self.curves.elapsed() / 60, 3),
            "step": trainer.global_step,
            "sequences": trainer.global_step * pl_module.hp.batch_size * trainer.world_size,
            "acceptance_length": tau("head"), "acceptance_length_se": se("head"),
            "acceptance_length_base": tau("base"),
            "acceptance_length_sampled": tau("head_sampled"), "acceptance_length_sampled_se": se("head_sampled"),
            "acceptance_length_base_sampled": tau("base_sampled"),
        }

    def write(self) -> None:
        """metrics/train_walk.json and plots/train_walk.csv (atomic; columns fixed, rows may be none)."""
        write_json(self.metrics_path, {"rows": self.rows})
        write_csv(self.csv_path, self.rows, columns=WALK_COLUMNS)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = list(state_dict.get("rows", []))


__all__ = ["TimeBudget", "TimedCheckpoint", "WalkClock", "WALK_COLUMNS"]
