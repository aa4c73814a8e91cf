"""retrain.group: a command's process group is drained, and SIGKILLed when it outlives the grace period.

Real processes: a group whose member ignores SIGTERM is taken down by `drain` after its seconds; an
exited group is not alive; `run_group` returns the command's code and no stop when none came.
Run: python -m pytest tests/retrain/test_group.py -q
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from dominospec.retrain.group import drain, group_alive, run_group

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def test_drain_kills_a_group_that_outlives_its_grace():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)  # ignored
    assert group_alive(proc.pid)
    t0 = time.monotonic()
    drain(proc.pid, seconds=0.5)
    assert 0.5 <= time.monotonic() - t0 < 10
    assert not group_alive(proc.pid)
    proc.wait(timeout=5)  # already reaped by drain (it reaps its own children in the group): no status left
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_run_group_returns_the_code_and_no_stop():
    code, stop = run_group([sys.executable, "-c", "import os, sys; sys.exit(3 if os.getpgid(0) == os.getpid() else 4)"],
                           os.environ)
    assert (code, stop) == (3, None)  # exit 3: the command led its own process group
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored
