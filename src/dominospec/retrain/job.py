"""`dominospec retrain`: new data snapshot -> pipeline -> gate -> registry -> champion or not.

Steps, under the retrain lock (lock.py):
  1. `retrain.commands` in order, each a subprocess that must exit 0: by default
     `dvc repro --force --single-item prepare` (re-prepare from `prepare.source`: the new snapshot)
     then `dvc repro` (everything downstream that changed, evaluate included);
  2. the gate score: `retrain.gate_suite` in `<paths.metrics>/eval.json`, which must describe the
     weights in `paths.draft` (its `draft_sha256`);
  3. one MLflow run with the draft and eval.json, registered as a new version of
     `retrain.registered_model`, tagged with its metrics, the git commit and the dvc.lock hash;
  4. the gate (gate.py) against the current champion; the alias `champion` moves only on a pass.

Every run that got the lock writes `<paths.metrics>/retrain.json` (decision promoted | rejected |
failed, the reason, versions, gate numbers) and prints the decision. Invariant: the champion moves
in the very last step, so a failed command, an exception or a SIGKILL anywhere before it leaves
the champion as it was; the kernel drops the lock of a killed run. A SIGTERM or SIGINT while a
command runs is passed to the command's whole process group (group.py: dvc does not pass it on to
its stage), awaited, and reported as a failure: the lock is released only once nothing of the
pipeline runs any more.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from dominospec.config import Params
from dominospec.errors import UserError
from dominospec.eval.prompts import suite_name
from dominospec.files import sha256_file, write_json
from dominospec.retrain.gate import decide, read_score
from dominospec.retrain.group import run_group
from dominospec.retrain.lock import RetrainLock
from dominospec.retrain.registry import Registry, eval_metrics, gate_tags
from dominospec.tracking import git_commit

DVC_LOCK = Path("dvc.lock")  # next to dvc.yaml: the retrain runs in the repository root


class RetrainFailed(UserError):
    """A pipeline command failed, or its outputs cannot be gated: nothing was registered."""


def check_gate_params(params: Params) -> None:
    """Refuse params the gate cannot judge, before any work: sampled evaluation, a gate suite not evaluated."""
    cfg = params.retrain
    if params.evaluate.temperature != 0:
        raise UserError(f"retrain needs greedy evaluation for its exact-match check: evaluate.temperature is "
                        f"{params.evaluate.temperature}, must be 0")
    suites = [suite_name(s) for s in params.evaluate.suites]
    if cfg.gate_suite not in suites:
        raise UserError(f"retrain.gate_suite {cfg.gate_suite!r} is not one of evaluate.suites {suites}")
    if not cfg.commands or not all(cfg.commands):
        raise UserError("retrain.commands must list at least one non-empty command")


def run_commands(commands: list[list[str]]) -> None:
    """Run each argv in order (output passes through); RetrainFailed at the first that does not exit 0,
    or when a SIGTERM / SIGINT stopped it: each runs as its own process group, which the stop reaches
    whole and which has ended when this returns (group.py).

    The interpreter's bin dir leads PATH, so `dvc` and the `python` of dvc.yaml's stage commands are
    the environment running the retrain (cron and systemd need no activated venv)."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    for argv in commands:
        print(f"retrain: $ {shlex.join(argv)}", flush=True)
        try:
            code, stop = run_group(argv, env)
        except OSError as err:
            raise RetrainFailed(f"`{shlex.join(argv)}` could not start: {err}") from None
        if stop is not None:
            raise RetrainFailed(f"stopped by {signal.Signals(stop).name} while `{shlex.join(argv)}` ran (it exited "
                                f"with {code}; its whole process group was signalled and has ended): the next "
                                f"retrain resumes the pipeline (train from its last.ckpt)")
        if code != 0:
            raise RetrainFailed(f"`{shlex.join(argv)}` exited with {code}")


def provenance() -> dict[str, str]:
    """-> what ties a version to its code and pipeline state: git commit, sha256 of dvc.lock."""
    lock_hash = sha256_file(DVC_LOCK) if DVC_LOCK.is_file() else "none"
    return {"git_commit": git_commit(), "dvc_lock_sha256": lock_hash}


def read_eval(params: Params) -> tuple[Path, dict[str, Any], str]:
    """-> eval.json's path and document, and the sha256 of the draft weights it describes (= paths.draft's)."""
    eval_json = Path(params.paths.metrics) / "eval.json"
    weights = Path(params.paths.draft) / "model.safetensors"
    if not eval_json.is_file() or not weights.is_file():
        raise RetrainFailed(f"the pipeline left no {eval_json if not eval_json.is_file() else weights}")
    report = json.loads(eval_json.read_text())
    draft_sha = sha256_file(weights)
    if report.get("draft_sha256") != draft_sha:
        raise RetrainFailed(f"{eval_json} describes draft weights {report.get('draft_sha256')} from "
                            f"{report.get('draft_dir')}, not the {draft_sha} in {params.paths.draft}")
    return eval_json, report, draft_sha


def retrain(params: Params) -> dict[str, Any]:
    """Params -> the retrain report (also written to `<paths.metrics>/retrain.json`); `report["decision"]`
    is "promoted" or "rejected"; a failure raises RetrainFailed after writing a "failed" report."""
    check_gate_params(params)
    cfg = params.retrain
    out = Path(params.paths.metrics) / "retrain.json"
    with RetrainLock(cfg.lock_file) as lock:
        if lock.stale_pid is not None:
            print(f"retrain: took over the lock {cfg.lock_file} left by pid {lock.stale_pid} (no longer running)")
        registry = Registry(params)
        record: dict[str, Any] = {"registered_model": registry.name, "pid": os.getpid(), "started": _now(),
                                  "champion_before": registry.champion_version(), "version": None}
        try:
            registry.champion_score()  # a champion without gate tags fails now, not after the pipeline
            run_commands(cfg.commands)
            eval_json, report, draft_sha = read_eval(params)
            score = read_score(report, cfg.gate_suite)
            champion = registry.champion_score()  # read again: the pipeline may have run for hours
            decision = decide(score, champion, cfg.tolerance)
            origin = provenance()
            tags = {**origin, "draft_sha256": draft_sha, **gate_tags(score, cfg.tolerance),
                    "gate.champion_before": champion.version if champion else "none",
                    **{f"eval.{k.replace('/', '.')}": str(v) for k, v in eval_metrics(report).items()}}
            run_id, source = registry.log_candidate(Path(params.paths.draft), eval_json, report, tags)
            record["version"] = version = registry.register(run_id, source, tags)  # tagged gate.decision pending
            registry.record(version, decision)
        except Exception as err:
            record.update(decision="failed", reason=str(err), champion=record["champion_before"], finished=_now())
            write_json(out, record)
            print(f"retrain: failed, {registry.name} champion stays version {record['champion_before']}: {err}")
            if isinstance(err, UserError):
                raise
            traceback.print_exc()  # a bug or a store error: keep its traceback, exit as a failure (2)
            raise RetrainFailed(f"{type(err).__name__}: {err}") from err
        if decision.promote:
            registry.promote(version)  # the last write: everything before it leaves the champion alone
        record.update(
            decision="promoted" if decision.promote else "rejected", reason=decision.reason,
            champion=version if decision.promote else (champion.version if champion else None),
            gate={"suite": score.suite, "acceptance_length": score.acceptance_length,
                  "acceptance_length_se": score.acceptance_length_se, "exact_match": score.exact_match,
                  "spec_mode": score.spec_mode, "tolerance": cfg.tolerance,
                  "champion_acceptance_length": champion.acceptance_length if champion else None},
            mlflow_run_id=run_id, draft_sha256=draft_sha, **origin, finished=_now())
        write_json(out, record)
    verdict = ("promoted to champion" if decision.promote
               else f"NOT promoted, champion stays version {record['champion']}")
    print(f"retrain: {registry.name} version {version} {verdict}: {decision.reason} (report: {out})")
    return record


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")

