"""The evaluation's plots: DVC plot files (CSV) and PNG figures for MLflow.

  eval_acceptance/<suite>.csv   position, domino, no_head   share of rounds accepting >= k drafts
  eval_tau.csv                  series, acceptance_length    τ per suite and draft mode
  eval_acceptance.png, eval_tau.png
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

ACCEPTANCE_DIR, TAU_CSV = "eval_acceptance", "eval_tau.csv"
ACCEPTANCE_PNG, TAU_PNG = "eval_acceptance.png", "eval_tau.png"


def write_plots(report: dict[str, Any], plots_dir: Path) -> list[Path]:
    """eval.json document -> CSV and PNG files under `plots_dir`; returns the PNG paths."""
    suites = report["suites"]
    acceptance_dir = plots_dir / ACCEPTANCE_DIR
    acceptance_dir.mkdir(parents=True, exist_ok=True)
    for stale in acceptance_dir.glob("*.csv"):  # suites of an earlier run
        stale.unlink()
    for name, suite in suites.items():
        rows = zip(suite["acceptance_by_position"], suite["acceptance_by_position_no_head"])
        _write_csv(acceptance_dir / f"{name}.csv", ["position", "domino", "no_head"],
                   [[k, _blank(a), _blank(b)] for k, (a, b) in enumerate(rows, start=1)])
    tau_rows = []
    for name, suite in suites.items():
        tau_rows.append([f"{name} {report['spec_mode']}", _blank(suite["acceptance_length"])])
        if report["spec_mode"] != "dflash":
            tau_rows.append([f"{name} no_head", _blank(suite["acceptance_length_no_head"])])
    _write_csv(plots_dir / TAU_CSV, ["series", "acceptance_length"], tau_rows)
    return [_acceptance_png(report, plots_dir / ACCEPTANCE_PNG), _tau_png(report, plots_dir / TAU_PNG)]


def _acceptance_png(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, suite in report["suites"].items():
        shares = suite["acceptance_by_position"]
        line = ax.plot(range(1, len(shares) + 1), shares, marker="o", label=f"{name} {report['spec_mode']}")[0]
        if report["spec_mode"] != "dflash":
            no_head = suite["acceptance_by_position_no_head"]
            ax.plot(range(1, len(no_head) + 1), no_head, ls="--", color=line.get_color(), label=f"{name} no head")
    ax.set(xlabel="draft position k", ylabel="share of rounds accepting >= k", ylim=(0, 1.02),
           title=f"Acceptance by block position (B={report['block_size']}, T={report['temperature']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _tau_png(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["suites"])
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.4
    spec = [report["suites"][n]["acceptance_length"] or 0 for n in names]
    no_head = [report["suites"][n]["acceptance_length_no_head"] or 0 for n in names]
    ax.bar([i - width / 2 for i in range(len(names))], spec, width, label=report["spec_mode"])
    ax.bar([i + width / 2 for i in range(len(names))], no_head, width, label="no head")
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="τ (tokens per verify round)", title="Acceptance length per suite")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def _blank(value: Any) -> Any:
    """None (nothing proposed at that position) -> an empty CSV cell."""
    return "" if value is None else round(value, 6)
