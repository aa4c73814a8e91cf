"""A pipeline command as its own process group; a stop (SIGTERM, SIGINT) to the retrain reaches all of it.

`dvc repro` does not pass a SIGTERM on to the stage it runs: dvc dies and the stage goes on,
orphaned (checked with dvc 3: a stage that traps SIGTERM never sees it). A scheduler that signals
only the job's main process (Kubernetes signals PID 1; `kill PID`) would then stop the retrain,
release its lock, and leave its training running beside the next retrain's, on the same checkpoint
folder. So each command starts a new session (its own process group: dvc and every stage it
spawns); a stop that reaches the retrain is passed to the whole group (the train stage saves
last.ckpt at its step and exits 143: train/preempt.py), and the retrain waits until the group is
empty before it reports and releases the lock. A group still alive `drain_seconds` after the
stop is SIGKILLed, as the scheduler would do after its grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Mapping, Optional, Sequence

STOPS = (signal.SIGTERM, signal.SIGINT)


def run_group(argv: Sequence[str], env: Mapping[str, str], drain_seconds: float = 600.0) -> tuple[int, Optional[int]]:
    """Run argv in a new process group -> (its exit code, the first stop signal received while it ran, or None).
    Raises OSError when it cannot start. Outside the main thread (no signal handlers there) the group
    is still its own, and nothing is forwarded."""
    proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        _signal_group(proc.pid, signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {stop: signal.signal(stop, forward) for stop in STOPS} if main else {}
    try:
        code = proc.wait()
        if received:
            drain(proc.pid, drain_seconds)
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
    return code, (received[0] if received else None)


def drain(pgid: int, seconds: float) -> None:
    """Wait until no process of group `pgid` is left (reaping those that were re-parented to this
    process, as happens when it is a container's PID 1); SIGKILL the group after `seconds`."""
    deadline = time.monotonic() + seconds
    while group_alive(pgid):
        if time.monotonic() > deadline:
            _signal_group(pgid, signal.SIGKILL)
            deadline = float("inf")  # after the SIGKILL, wait for the kernel to take them down
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Does process group `pgid` still have a member that has not exited?"""
    try:
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:  # our own children in it: reap their exit
            pass
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the group has ended already
        pass
