"""A stand-in for `dvc repro` in the retrain tests: writes what export + evaluate would, in milliseconds.

`retrain.commands` runs `python fake_pipeline.py --params params.yaml` in the test's workspace. It
reads `candidate.json` there, {"tau", "exact_match", "action"}, and with action
  ok     writes paths.draft (config.json + model.safetensors unique to this run), dvc.lock and
         <paths.metrics>/eval.json (eval/stage.py's keys: suites.<name>.walk.domino.acceptance_length = tau, ...);
  exit   writes half a draft, then exits 3 (a crashed `dvc repro`);
  hang   writes `started` (its pid), waits until `release` exists (60 s at most), then as ok;
  stale_eval  as ok, then replaces the draft's weights (eval.json no longer describes them);
  stage  as `dvc repro` running a stage: starts a child in its own process group (the "stage", which
         traps SIGTERM, writes `stage_got_sigterm`, takes 1 s to save, writes `stage_saved`, exits 143),
         writes `started` (the child's pid), then waits for it. Like dvc it keeps SIGTERM's default
         action: signalled alone, it dies and the stage goes on, orphaned.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from dominospec.config import load_params


STAGE = """
import os, signal, sys, time
from pathlib import Path
def stop(*_):
    Path("stage_got_sigterm").write_text("1")
    time.sleep(1.0)  # a checkpoint being saved
    Path("stage_saved").write_text("1")
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
Path("stage_ready").write_text(str(os.getpid()))
time.sleep(60)
"""


def write_outputs(params, tau: float, exact_match: float) -> None:
    draft = Path(params.paths.draft)
    draft.mkdir(parents=True, exist_ok=True)
    (draft / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 8}))
    weights = f"weights tau={tau} t={time.time_ns()} pid={os.getpid()}".encode()  # unique per run
    (draft / "model.safetensors").write_bytes(weights)
    Path("dvc.lock").write_text(f"schema: '2.0'\nstages: {{}}  # {time.time_ns()}\n")

    def suite(t: float) -> dict:  # the gate reads the walk's τ; the engine's auto-K τ is flat on purpose
        walk = {"num_draft": 7, "domino": {"acceptance_length": t, "acceptance_length_se": 0.02},
                "dflash": {"acceptance_length": t - 0.05, "acceptance_length_se": 0.02}}
        return {"acceptance_length": 1.0, "acceptance_length_se": 0.02, "exact_match": exact_match,
                "speedup": 1.1, "n_prompts": 16, "acceptance_length_no_head": 1.0, "walk": walk}

    report = {"suites": {"sharegpt": suite(tau), "humaneval": suite(tau - 0.1)}, "empty_suites": {},
              "spec_mode": "domino", "draft_dir": str(draft), "draft_sha256": hashlib.sha256(weights).hexdigest()}
    metrics = Path(params.paths.metrics)
    metrics.mkdir(parents=True, exist_ok=True)
    (metrics / "eval.json").write_text(json.dumps(report))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", required=True)
    params = load_params(parser.parse_args().params)
    candidate = json.loads(Path("candidate.json").read_text())
    if candidate["action"] == "exit":
        Path(params.paths.draft).mkdir(parents=True, exist_ok=True)
        (Path(params.paths.draft) / "model.safetensors").write_bytes(b"half")
        print("fake pipeline: dying mid-run", file=sys.stderr)
        return 3
    if candidate["action"] == "stage":
        import subprocess

        stage = subprocess.Popen([sys.executable, "-c", STAGE])
        while not Path("stage_ready").exists():
            time.sleep(0.02)
        Path("started").write_text(str(stage.pid))
        return stage.wait()
    if candidate["action"] == "hang":
        Path("started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not Path("release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    write_outputs(params, candidate["tau"], candidate["exact_match"])
    if candidate["action"] == "stale_eval":  # the export changed after evaluate measured it
        (Path(params.paths.draft) / "model.safetensors").write_bytes(b"other weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
