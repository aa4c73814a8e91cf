"""Preemption: a SIGTERM (SLURM, Kubernetes, `timeout -s TERM`) -> last.ckpt where it came, exit 143.

Lightning's signal connector only records a SIGTERM (`trainer.received_sigterm`); its loops raise
SIGTERMException at the end of the training step it came in (after that step's validation,
scheduler step, CurveRecorder row and progress counters: restored as RESTARTED_ON_LAST, the rerun
trains the next step), after a validation batch that is not the last (the rerun finishes that
validation), and at the end of the epoch. PreemptionCheckpoint saves then; raise_if_preempted
covers what comes after those checks (on_train_end hooks, the last batch of `validate`). Once
`validate` has returned, SIGTERM has its default action again: the process ends at once.
SIGTERMException is a SystemExit without a code, i.e. exit status 0: `preemptible` makes it 143.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: the status a shell reports for a process ended by SIGTERM


def save_last(trainer: L.Trainer, ckpt_dir: Path, reason: str = "SIGTERM") -> Path:
    """The trainer's whole state -> ckpt_dir/last.ckpt, atomically: written under a temporary name in
    the same folder, then renamed, so a save cut short leaves the previous last.ckpt whole.
    Call on every rank: each dumps its state, rank 0 writes, all meet at a barrier. `reason` is logged."""
    last, tmp = ckpt_dir / "last.ckpt", ckpt_dir / "last.ckpt.tmp"
    trainer.save_checkpoint(tmp)
    if trainer.is_global_zero:
        os.replace(tmp, last)
    rank_zero_info(f"{reason}: saved step {trainer.global_step} to {last}; rerun the stage to resume")
    return last


class PreemptionCheckpoint(L.Callback):
    """On SIGTERMException only -> save_last; the exception goes on. Other errors save nothing:
    the state they leave (a step half done, NaNs) is no place to resume from."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            save_last(trainer, self.ckpt_dir)


def raise_if_preempted(trainer: L.Trainer, ckpt_dir: Path) -> None:
    """After `fit` or `validate`: a SIGTERM that came after the loops' last check (an on_train_end
    hook, the last batch of `validate`) let Lightning return normally -> save_last, SIGTERMException.
    Call right after each: the next `fit`/`validate` clears `received_sigterm`. (A save during
    `validate` counts that validation in CurveRecorder's train_seconds.)"""
    if trainer.received_sigterm:
        save_last(trainer, ckpt_dir)
        raise SIGTERMException(SIGTERM_EXIT)


@contextmanager
def preemptible() -> Iterator[None]:
    """SIGTERMException leaving the block -> the same with exit status 143, so that a scheduler sees
    a preempted run as stopped, not as finished."""
    try:
        yield
    except SIGTERMException as stop:
        if stop.code:  # raise_if_preempted's carries it already
            raise
        raise SIGTERMException(SIGTERM_EXIT) from stop
