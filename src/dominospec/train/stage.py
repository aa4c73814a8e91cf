"""The `train` stage: hidden-state cache -> draft checkpoints, metrics/train.json, one MLflow run.

Outputs (params `paths`):
  checkpoints/last.ckpt, step-*.ckpt   Lightning checkpoints (automatic resume after a crash;
                                       a SIGTERM saves last.ckpt at its step and exits 143: preempt.py)
  checkpoints/final/                   the inner draft model, `save_pretrained` (what export reads)
  checkpoints/run.json                 fingerprint of what is being trained + MLflow run id
  metrics/train.json                   acceptance length head on/off, accuracy by position, steps, minutes
  plots/train_curve.csv                step, loss, loss_base, loss_final, lambda, lr (DVC plot)
  plots/val_accuracy_by_position.csv   position, accuracy (head on), accuracy_base (DVC plot)
  metrics/train_walk.json,             the val walk's τ (greedy, sampled) at train.walk_minutes of
  plots/train_walk.csv                 training wall time, with step and sequences seen (train/timed.py)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dominospec.config import Params, as_flat_dict
from dominospec.files import code_digest
from dominospec.precision import resolve_precision
from dominospec.target import float32_matmul
from dominospec.train.curves import CurveRecorder, write_train_outputs
from dominospec.train.preempt import PreemptionCheckpoint, preemptible, raise_if_preempted
from dominospec.train.timed import TimeBudget, TimedCheckpoint, WalkClock


def run_fingerprint(params: Params, data_fingerprint: str) -> str:
    """Hash of everything that makes a checkpoint resumable: draft, train params, data, target, code."""
    keys = {k: v for k, v in as_flat_dict(params).items() if k.split(".")[0] in ("draft", "train", "target")}
    for kernel_key in ("train.ce_kernel", "train.distill_kernel"):
        keys.pop(kernel_key, None)  # the same losses either way: a run may resume on another device
    for clock_key in ("train.checkpoint_minutes", "train.walk_minutes", "train.val_walk_temperature",
                      "train.max_minutes"):
        keys.pop(clock_key, None)  # when to save and what to log: the same weights, a slice may change them
    blob = json.dumps({"params": keys, "data": data_fingerprint, "code": code_digest()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resumable_checkpoint(ckpt_dir: Path, fingerprint: str) -> tuple[Optional[Path], Optional[str]]:
    """-> (last.ckpt, mlflow run id) when the folder holds a checkpoint of this run, else (None, None)."""
    record = ckpt_dir / "run.json"
    if record.is_file():
        info = json.loads(record.read_text())
        last = ckpt_dir / "last.ckpt"
        if info.get("fingerprint") == fingerprint and last.is_file():
            return last, info.get("mlflow_run_id")
    return None, None


def prepare_checkpoint_dir(ckpt_dir: Path, fingerprint: str) -> tuple[Optional[Path], Optional[str]]:
    """Keep checkpoints of the same run (-> (last.ckpt, mlflow run id)); wipe those of another."""
    last, run_id = resumable_checkpoint(ckpt_dir, fingerprint)
    if last is not None:
        return last, run_id
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True)
    return None, None


def write_run_record(ckpt_dir: Path, fingerprint: str, run_id: Optional[str]) -> None:
    tmp = ckpt_dir / "run.json.tmp"
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "mlflow_run_id": run_id}, indent=2))
    tmp.replace(ckpt_dir / "run.json")


def train(params: Params, callbacks: Sequence[Any] = ()) -> None:
    """Params -> trained draft under paths.checkpoints (+ metrics, plots, MLflow run). `callbacks`:
    extra Lightning callbacks for the fit (benchmarks/ddp_scaling.py times the steps with one)."""
    with training_numerics(), preemptible():
        _fit(params, list(callbacks))


# scaled_dot_product_attention's backends while training: all but cuDNN, which builds an execution
# plan for every new shape (tens of ms on the host for a backward) while training batches change
# length every step; on an H200 the plans took more host time than a whole step's kernels
# (benchmarks/train_step_gpu.py). The memory-efficient and flash kernels need no plan.
TRAINING_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def training_numerics() -> Iterator[None]:
    """The process-wide torch settings a training run takes, restored after: TF32 for the draft's
    fp32 parts, and attention without cuDNN (TRAINING_ATTENTION)."""
    with float32_matmul("high"), sdpa_kernel(TRAINING_ATTENTION):
        yield


def _fit(params: Params, extra_callbacks: list[Any]) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.utilities import rank_zero_only

    from dominospec.train.build import TrainingSetup, build_training
    from dominospec.tracking import flat_params, lightning_logger

    L.seed_everything(params.train.seed, workers=True)
    setup: TrainingSetup = build_training(params)

    ckpt_dir = Path(params.paths.checkpoints)
    fingerprint = run_fingerprint(params, setup.data_fingerprint)
    # DDP: Lightning's launcher starts ranks 1.. as copies of this process once rank 0 is inside
    # `fit`, i.e. after rank 0 has prepared the folder and recorded its MLflow run: they only read it.
    if rank_zero_only.rank == 0:
        resume_from, run_id = prepare_checkpoint_dir(ckpt_dir, fingerprint)
    else:
        resume_from, run_id = resumable_checkpoint(ckpt_dir, fingerprint)
    logger = lightning_logger(params, "train", run_id=run_id)
    if rank_zero_only.rank == 0:
        write_run_record(ckpt_dir, fingerprint, logger.run_id)
    if resume_from is None:
        logger.log_hyperparams(flat_params(params))

    curves = CurveRecorder()
    clock = [TimedCheckpoint(ckpt_dir, params.train.checkpoint_minutes)] if params.train.checkpoint_minutes else []
    clock += [TimeBudget(params.train.max_minutes, curves)] if params.train.max_minutes else []
    walk_clock = WalkClock(list(params.train.walk_minutes), curves, Path(params.paths.metrics), Path(params.paths.plots))
    checkpoints = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="step-{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=params.train.checkpoint_every_steps,
        save_last=True,
        save_top_k=-1,
        enable_version_counter=False,  # overwrite a last.ckpt it did not write (preempt.py's): never last-v1.ckpt
    )
    trainer = L.Trainer(
        max_steps=params.train.max_steps,
        max_epochs=1,  # StepBatchSampler yields every step's batch in one pass
        accelerator=params.train.accelerator,
        devices=params.train.devices,
        num_nodes=params.train.num_nodes,
        strategy=lightning_strategy(params),
        use_distributed_sampler=False,  # StepBatchSampler shards by rank itself
        precision=resolve_precision(params.train.precision, params.train.accelerator),
        gradient_clip_val=params.train.grad_clip,
        val_check_interval=params.train.val_every_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=params.train.log_every_steps,
        logger=logger,
        callbacks=[checkpoints, *clock, PreemptionCheckpoint(ckpt_dir), curves, walk_clock,
                   LearningRateMonitor(logging_interval="step"), *extra_callbacks],
        enable_progress_bar=True,
        default_root_dir=str(ckpt_dir),
    )
    trainer.fit(setup.module, datamodule=setup.datamodule, ckpt_path=str(resume_from) if resume_from else None)
    raise_if_preempted(trainer, ckpt_dir)  # no final outputs after a SIGTERM: the rerun writes them
    trainer.validate(setup.module, datamodule=setup.datamodule, verbose=False)
    raise_if_preempted(trainer, ckpt_dir)
    if trainer.is_global_zero:
        setup.module.draft.save_pretrained(ckpt_dir / "final", safe_serialization=True)
        summary = setup.module.final_validation()
        # Minutes of optimisation over every invocation (a resumed run counts its earlier part).
        write_train_outputs(params, trainer, curves, summary, minutes=curves.train_seconds / 60, logger=logger)
        walk_clock.write()  # metrics/train_walk.json, plots/train_walk.csv: the rows (none without walk_minutes)


def lightning_strategy(params: Params) -> Any:
    """params.train.strategy -> a Lightning strategy. DDP skips broadcasting the frozen target
    buffers (embedding, LM head: identical on every rank) and tolerates an unused head."""
    if params.train.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(broadcast_buffers=False, find_unused_parameters=not params.draft.use_domino_head)
    return params.train.strategy


