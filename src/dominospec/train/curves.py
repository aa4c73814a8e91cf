"""Training curves and the train stage's outputs: metrics/train.json, DVC plots, MLflow artifacts."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L

from dominospec.config import Params
from dominospec.files import write_json

CURVE_KEYS = ("train/loss", "train/loss_base", "train/loss_final", "train/lambda", "train/lr")


class CurveRecorder(L.Callback):
    """Keeps (step, loss, loss_base, loss_final, lambda, lr) rows and the training wall time;
    both are saved in checkpoints, so a resumed run's curve and minutes are complete."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.train_seconds = 0.0  # optimisation time of all invocations up to the last checkpoint
        self._since: Optional[float] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._since = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._bank()
        self._since = None  # the clock stops: a checkpoint saved later (a SIGTERM in the final validation) adds nothing

    def elapsed(self) -> float:
        """Training wall seconds so far, earlier invocations included (up to their last checkpoint)."""
        return self.train_seconds + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def _bank(self) -> None:
        if self._since is not None:
            now = time.perf_counter()
            self.train_seconds += now - self._since
            self._since = now

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % max(1, trainer.log_every_n_steps) != 0:
            return
        logged = trainer.callback_metrics
        row = {"step": step}
        for key in CURVE_KEYS:
            if key in logged:
                row[key.split("/")[1]] = float(logged[key])
        self.rows.append(row)

    def state_dict(self) -> dict[str, Any]:
        self._bank()
        return {"rows": self.rows, "train_seconds": self.train_seconds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = list(state_dict.get("rows", []))
        self.train_seconds = float(state_dict.get("train_seconds", 0.0))


def write_csv(path: Path, rows: list[dict[str, Any]], columns: Sequence[str] = ()) -> None:
    """rows -> CSV at path (atomic), columns `columns` then the union of the rows' keys in first-seen order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(columns)
    for row in rows:
        columns += [k for k in row if k not in columns]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def plot_curves(rows: list[dict[str, Any]], out: Path) -> None:
    """Loss curves (base, final, total) and lambda over steps -> PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in rows]
    for key in ("loss", "loss_base", "loss_final"):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=key)
    ax.set_xlabel("step"), ax.set_ylabel("weighted CE"), ax.legend(), ax.set_title("training loss")
    ax2.plot(steps, [r.get("lambda", float("nan")) for r in rows], label="lambda (base weight)")
    ax2.plot(steps, [r.get("lr", float("nan")) / max(1e-12, max(r.get("lr", 0) for r in rows)) for r in rows],
             label="lr / max lr")
    ax2.set_xlabel("step"), ax2.legend(), ax2.set_title("curriculum and schedule")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_accuracy(summary: dict[str, Any], out: Path) -> None:
    """Top-1 accuracy by block position, head on vs head off -> PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    acc, base = summary["accuracy_by_position"], summary["accuracy_by_position_base"]
    ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"Domino (tau {summary['acceptance_length']:.2f})")
    ax.plot(range(1, len(base) + 1), base, marker="s", label=f"head off (tau {summary['acceptance_length_base']:.2f})")
    ax.set_xlabel("block position (draft token k)"), ax.set_ylabel("P(first k accepted)")
    ax.set_ylim(0, 1), ax.legend(), ax.set_title("validation acceptance by position")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def summary_metrics(summary: dict[str, Any], steps: int, minutes: float) -> dict[str, Any]:
    """Validation summary -> the metrics/train.json document."""
    return {
        "val_acceptance_length": summary["acceptance_length"],
        "val_acceptance_length_base": summary["acceptance_length_base"],
        "val_accuracy_by_position": summary["accuracy_by_position"],
        "val_accuracy_by_position_base": summary["accuracy_by_position_base"],
        "val_loss": summary.get("loss"),
        # Engine-faithful τ: each val reply walked round by round as the engine decodes it
        # (train/walk.py); predicts the evaluate stage's τ when the val replies are the target's own.
        "val_walk_acceptance_length": summary["walk"]["acceptance_length"],
        "val_walk_acceptance_length_se": summary["walk"]["acceptance_length_se"],
        "val_walk_acceptance_length_base": summary["walk_base"]["acceptance_length"],
        "val_walk_acceptance_by_position": summary["walk"]["acceptance_by_position"],
        **sampled_walk_metrics(summary),
        "val_walk_replies": summary["walk"]["replies"],
        "val_walk_rounds": summary["walk"]["rounds"],  # over each reply's first train.val_walk_tokens tokens
        "steps": steps,
        "train_minutes": round(minutes, 4),
    }


def sampled_walk_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The sampled val walk's τ (train.val_walk_temperature), head on (± SE) and off; {} without one."""
    if "walk_sampled" not in summary:
        return {}
    return {
        "val_walk_acceptance_length_sampled": summary["walk_sampled"]["acceptance_length"],
        "val_walk_acceptance_length_sampled_se": summary["walk_sampled"]["acceptance_length_se"],
        "val_walk_acceptance_length_base_sampled": summary.get("walk_base_sampled", summary["walk_sampled"])["acceptance_length"],
    }


def write_train_outputs(params: Params, trainer: L.Trainer, curves: CurveRecorder, summary: dict[str, Any],
                        minutes: float, logger: Any) -> dict[str, Any]:
    """Write metrics/train.json, the DVC plot CSVs and PNGs, and log them to the MLflow run."""
    metrics = summary_metrics(summary, steps=trainer.global_step, minutes=minutes)
    metrics_path = Path(params.paths.metrics) / "train.json"
    write_json(metrics_path, metrics)
    plots = Path(params.paths.plots)
    write_csv(plots / "train_curve.csv", curves.rows)
    write_csv(plots / "val_accuracy_by_position.csv", [
        {"position": k + 1, "accuracy": a, "accuracy_base": b}
        for k, (a, b) in enumerate(zip(summary["accuracy_by_position"], summary["accuracy_by_position_base"]))
    ])
    plot_curves(curves.rows, plots / "train_curve.png")
    plot_accuracy(summary, plots / "val_accuracy_by_position.png")
    client, run_id = logger.experiment, logger.run_id
    for key in ("val_acceptance_length", "val_acceptance_length_base", "train_minutes"):
        client.log_metric(run_id, f"final/{key}", float(metrics[key]))
    for path in (metrics_path, plots / "train_curve.csv", plots / "train_curve.png",
                 plots / "val_accuracy_by_position.png"):
        client.log_artifact(run_id, str(path))
    return metrics
