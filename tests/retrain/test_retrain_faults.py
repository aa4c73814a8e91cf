"""Retrains that fail, die or collide: the champion never moves, the lock never wedges.

Real processes: `dominospec retrain` runs as a subprocess whose pipeline command dies, or is
SIGKILLed mid-pipeline; a second retrain starts while the first holds the lock.
"""

import os
import signal
import time

import pytest

from dominospec.retrain.job import RetrainFailed, retrain
from dominospec.retrain.lock import RetrainLock, RetrainLocked

WAIT_S = 30


def wait_for(path, proc):
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def versions(registry):
    return sorted(str(v.version) for v in registry.client.search_model_versions(f"name='{registry.name}'"))


def test_crashed_pipeline_leaves_the_champion_and_no_version(workspace, registry):
    workspace.candidate(tau=1.30)
    retrain(workspace.params())
    workspace.candidate(action="exit")  # the pipeline command dies mid-run
    proc = workspace.cli()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert "exited with 3" in err and "champion stays version 1" in out
    assert registry.champion_version() == "1" and versions(registry) == ["1"]
    report = workspace.report()
    assert report["decision"] == "failed" and report["champion"] == "1" and "exited with 3" in report["reason"]
    workspace.candidate(tau=1.50)  # the lock is free again
    assert retrain(workspace.params())["decision"] == "promoted"


def test_metrics_that_do_not_describe_the_export_are_not_registered(workspace, registry):
    workspace.candidate(tau=1.30)
    retrain(workspace.params())
    workspace.candidate(tau=2.0, action="stale_eval")
    with pytest.raises(RetrainFailed, match="describes draft weights"):
        retrain(workspace.params())
    assert registry.champion_version() == "1" and versions(registry) == ["1"]
    assert workspace.report()["decision"] == "failed"


def test_sigkill_mid_retrain_leaves_the_champion_and_a_lock_that_is_taken_over(workspace, registry, capsys):
    workspace.candidate(tau=1.30)
    retrain(workspace.params())
    workspace.candidate(tau=9.0, action="hang")
    proc = workspace.cli()
    wait_for(workspace.root / "started", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the retrain and its pipeline command, as an OOM killer would
    proc.wait(timeout=WAIT_S)
    assert registry.champion_version() == "1" and versions(registry) == ["1"]
    assert (workspace.root / ".retrain.lock").read_text().strip() == str(proc.pid)  # left behind
    workspace.candidate(tau=1.20)
    report = retrain(workspace.params())  # takes the dead holder's lock over, gates as usual
    assert f"left by pid {proc.pid}" in capsys.readouterr().out
    assert report["decision"] == "rejected" and registry.champion_version() == "1"


def test_a_second_retrain_is_refused_while_one_runs(workspace, registry):
    workspace.candidate(tau=1.30, action="hang")
    first = workspace.cli()
    wait_for(workspace.root / "started", first)
    with pytest.raises(RetrainLocked, match=f"another retrain is running \\(pid {first.pid}, lock .retrain.lock\\)"):
        retrain(workspace.params())
    (workspace.root / "release").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, (out, err)  # the first one finishes undisturbed
    assert "dominospec-draft version 1 promoted to champion" in out
    assert registry.champion_version() == "1" and versions(registry) == ["1"]


def test_lock_is_exclusive_and_released(tmp_path):
    path = tmp_path / "retrain.lock"
    with RetrainLock(path):
        assert path.read_text().strip() == str(os.getpid())
        with pytest.raises(RetrainLocked, match=f"pid {os.getpid()}"):
            RetrainLock(path).acquire()  # a second open file: flock conflicts even within one process
    assert path.read_text() == ""  # released: no holder recorded
    with RetrainLock(path) as again:
        assert again.stale_pid is None


def test_sigterm_to_the_retrain_reaches_the_stage_and_is_awaited(workspace, registry):
    """A scheduler that signals only the retrain (Kubernetes' PID 1, `kill PID`): the stage running
    under the pipeline command gets the SIGTERM too, the retrain waits until it has saved and exited,
    then reports a failure that names the signal; the champion stays, the lock is free."""
    workspace.candidate(tau=1.30)
    retrain(workspace.params())
    workspace.candidate(tau=9.0, action="stage")
    proc = workspace.cli()
    wait_for(workspace.root / "started", proc)
    stage_pid = int((workspace.root / "started").read_text())
    os.kill(proc.pid, signal.SIGTERM)  # the retrain alone, not its group
    out, err = proc.communicate(timeout=WAIT_S)
    assert (workspace.root / "stage_got_sigterm").exists(), "the stage never saw the SIGTERM"
    assert (workspace.root / "stage_saved").exists(), "the retrain exited before the stage had saved"
    with pytest.raises(ProcessLookupError):
        os.kill(stage_pid, 0)  # nothing of the pipeline runs on
    assert proc.returncode == 2, (out, err)
    report = workspace.report()
    assert report["decision"] == "failed" and "stopped by SIGTERM" in report["reason"], report
    assert registry.champion_version() == "1" and versions(registry) == ["1"]
    workspace.candidate(tau=1.50)  # the lock is free again
    assert retrain(workspace.params())["decision"] == "promoted"
