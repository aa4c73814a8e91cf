"""One retrain at a time: an exclusive `flock` on `retrain.lock_file`, holding the holder's pid.

Invariant: the kernel's lock is the truth, the pid in the file is only for messages. The kernel
drops the lock when its holder dies however it dies (SIGKILL included), so a lock file left by a
dead process is simply taken over; a live holder makes a second retrain fail at once, naming its
pid. The descriptor is not inherited by the pipeline's subprocesses (Python's default), so the
lock lives exactly as long as the retrain process.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Optional

from dominospec.errors import UserError


class RetrainLocked(UserError):
    """Another live process holds the retrain lock."""


def _recorded_pid(fd: int) -> Optional[int]:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


class RetrainLock:
    """`with RetrainLock(path) as lock:` holds the lock; `lock.stale_pid` names a dead holder taken over."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.stale_pid: Optional[int] = None
        self._fd: Optional[int] = None

    def acquire(self) -> "RetrainLock":
        """Take the lock, or raise `RetrainLocked` naming the live holder; never waits."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _recorded_pid(fd)
            os.close(fd)
            raise RetrainLocked(f"another retrain is running (pid {holder if holder is not None else 'unknown'}, "
                                f"lock {self.path}); this one stops without touching anything") from None
        previous = _recorded_pid(fd)
        if previous is not None and previous != os.getpid():
            self.stale_pid = previous  # its holder died without unlocking (killed or crashed)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Empty the file (no pid = nobody holds it) and drop the lock."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RetrainLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
