"""benchmarks/ddp_scaling.py: the process check, and its --smoke (2 gloo processes) end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "ddp_scaling.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("ddp_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_log(work: Path, entries: list[tuple[int, str, str | None, str | None]]) -> None:
    """(pid, role, run, LOCAL_RANK) rows -> WORK/invocations.jsonl."""
    lines = [json.dumps({"pid": pid, "role": role, "run": run, "local_rank": rank, "argv": []})
             for pid, role, run, rank in entries]
    (work / "invocations.jsonl").write_text("\n".join(lines) + "\n")


def test_process_check_accepts_one_train_per_rank_and_refuses_a_rank_that_does_more(tmp_path):
    bench = load_benchmark()
    me = os.getpid()
    good = [(me, "benchmark", None, None), (me, "prepare", None, None), (me, "regenerate", None, None),
            (11, "train", "1dev", None), (12, "train", "2dev", None), (13, "train", "2dev", "1")]
    write_log(tmp_path, good)
    assert len(bench.check_invocations(tmp_path, {"1dev": 1, "2dev": 2}, prepared_here=True)) == 6

    bad = {
        "a rank 1 that prepares again": good + [(13, "prepare", None, None)],
        "a rank 1 that also trains the other run": good + [(13, "train", "1dev", "1")],
        "a DDP run with one process": good[:-1],
        "the benchmark re-executed": good + [(14, "benchmark", None, "1")],
    }
    for why, entries in bad.items():
        write_log(tmp_path, entries)
        with pytest.raises(SystemExit, match="process check failed"):
            bench.check_invocations(tmp_path, {"1dev": 1, "2dev": 2}, prepared_here=True)
        print("refused:", why)
    write_log(tmp_path, good)  # data stages logged, but this process reused the shared folder
    with pytest.raises(SystemExit, match="data stages expected not at all"):
        bench.check_invocations(tmp_path, {"1dev": 1, "2dev": 2}, prepared_here=False)


@pytest.mark.slow
def test_smoke_two_gloo_processes_against_one(tmp_path):
    """--smoke: prepare once, 12 steps on one process against 6 on two (the same sequences), each
    train in its own processes only, the DDP run's train.json validation pooled over both ranks."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--work", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.strip().splitlines()[-1].startswith("| 2dev ÷ 1dev |")

    report = json.loads((tmp_path / "ddp_scaling.json").read_text())
    one, two = report["runs"]["1dev"], report["runs"]["2dev"]
    assert (one["devices"], one["steps"], two["devices"], two["steps"]) == (1, 12, 2, 6)
    assert one["blocks_seen"] == two["blocks_seen"] and one["tokens_seen"] == two["tokens_seen"]
    assert report["process_group_backend"] == "gloo" and report["scaling"]["tokens_per_s"] > 0
    roles = [(e["role"], e["run"], e["local_rank"]) for e in report["invocations"]]
    assert roles == [("benchmark", None, None), ("prepare", None, None), ("regenerate", None, None),
                     ("train", "1dev", None), ("train", "2dev", None), ("train", "2dev", "1")]
    # the DDP run's own validation covers both ranks' val sequences: as the one-device re-validation
    assert two["train_json"]["val_walk_replies"] == two["validation"]["walk_replies"] == 8
    assert two["train_json"]["val_walk_acceptance_length"] == pytest.approx(two["validation"]["walk_tau"])
    assert two["train_json"]["val_walk_acceptance_length_se"] == pytest.approx(two["validation"]["walk_tau_se"])
    # rank 1 left rank 0's checkpoint folder and MLflow run alone
    assert json.loads((tmp_path / "2dev" / "checkpoints" / "run.json").read_text())["mlflow_run_id"]
    assert (tmp_path / "2dev" / "checkpoints" / "final" / "model.safetensors").is_file()
