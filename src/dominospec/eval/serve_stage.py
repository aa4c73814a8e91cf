"""The `serve_eval` stage: the exported draft served as `make serve` serves it, measured over HTTP.

`serve_eval(params)`:
  1. picks the backend as `dominospec serve` does (serve.backend, serve.mode and the target): stock
     SGLang with the DFLASH + Domino flags on a CUDA host where `sglang` is importable and the target
     is an HF checkpoint, else the built-in server (whose engine takes engine.head_kernel: auto runs
     the Triton head on CUDA, torch ops elsewhere);
  2. starts `python -m dominospec.cli serve --params <file> --host 127.0.0.1 --port <free port>
     --backend <it> --no-champion` as a child in a process group of its own (paths.draft, not the
     registry's champion: the stage measures this pipeline's export), its output in a log file;
  3. waits until GET /health answers 200, at most serve_eval.startup_timeout_s; a server that exits
     first, or is not healthy in time, fails the stage with why and the log's tail;
  4. runs the served evaluation (eval.served.evaluate_server) on the first serve_eval.max_prompts
     prompts of each evaluate suite, serve_eval.max_new_tokens each, at c = 1 and c =
     evaluate.server_concurrency -> `paths.metrics`/serve_eval.json (atomic), plus "backend",
     "serve_mode", "max_prompts", "startup_s" and "draft_sha256";
  5. always stops the server (`Server.stop`): SIGTERM to its process group, SIGKILL after
     serve_eval.stop_timeout_s, and returns once no process of the group is left; on success, on
     an error, on Ctrl-C and on a SIGTERM of the stage (raised as KeyboardInterrupt while the server
     runs). Its own process group keeps the server out of the terminal's Ctrl-C: the stage stops it.
The log is removed after a clean stop; after a failure of the server it is kept and named in the error.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

from dominospec.config import Params, ServeEvalParams
from dominospec.errors import UserError

HOST = "127.0.0.1"
POLL_S = 0.25  # between /health probes
KILL_WAIT_S = 10.0  # after SIGKILL, the longest wait for the kernel to take the group down
LOG_TAIL = 3000  # characters of the server's log in an error
SETTLE_S = 1.0  # after a failed evaluation, the longest wait for a dying server's exit status


def serve_eval(params: Params) -> dict[str, Any]:
    """Params -> serve paths.draft, run the served evaluation, stop the server -> the serve_eval.json document."""
    from dominospec.eval.served import evaluate_server
    from dominospec.export.sglang_launch import sglang_command
    from dominospec.files import sha256_file
    from dominospec.serve.launch import resolve_backend

    cfg = params.serve_eval
    check_params(cfg)
    backend = resolve_backend(params.serve.backend, params.serve.mode, params.target)
    if backend == "sglang":
        sglang_command(params, HOST, 0)  # a target or draft SGLang cannot serve fails here, not in the child
    weights = Path(params.paths.draft) / "model.safetensors"
    if params.serve.mode != "ar" and not weights.is_file():
        raise UserError(f"paths.draft: no exported draft at {params.paths.draft} (model.safetensors missing): "
                        "run `dvc repro export`")
    sized = dataclasses.replace(params, evaluate=dataclasses.replace(
        params.evaluate, max_prompts=cfg.max_prompts, max_new_tokens=cfg.max_new_tokens))
    extra = {"backend": backend, "serve_mode": params.serve.mode, "max_prompts": cfg.max_prompts,
             "draft_sha256": sha256_file(weights) if weights.is_file() else None}
    with running(params, backend) as server:
        try:
            return evaluate_server(sized, server.url, out=str(Path(params.paths.metrics) / "serve_eval.json"),
                                   extra={**extra, "startup_s": server.startup_s})
        except (UserError, httpx.HTTPError) as err:  # HTTPError: a connection the server dropped as it died
            why = str(err) if isinstance(err, UserError) else f"{server.url}: {type(err).__name__}: {err}"
            raise server.failure(f"the served evaluation failed: {why}", settle_s=SETTLE_S) from None


def check_params(cfg: ServeEvalParams) -> None:
    """Range checks params.yaml's types cannot express; UserError naming `serve_eval.<key>` and its value."""
    for key in ("max_prompts", "max_new_tokens"):
        if getattr(cfg, key) < 1:
            raise UserError(f"serve_eval.{key} must be >= 1, got {getattr(cfg, key)}")
    for key in ("startup_timeout_s", "stop_timeout_s"):
        if not getattr(cfg, key) > 0:  # NaN included
            raise UserError(f"serve_eval.{key} must be > 0 seconds, got {getattr(cfg, key)}")


@contextmanager
def running(params: Params, backend: str) -> Iterator["Server"]:
    """`dominospec serve` on paths.draft, healthy, for the duration of the block; stopped on any way out."""
    cfg = params.serve_eval
    port = free_port(HOST)
    argv = [sys.executable, "-m", "dominospec.cli", "serve", "--params", str(params.source), "--host", HOST,
            "--port", str(port), "--backend", backend, "--no-champion"]
    with interrupted_by_sigterm():
        server = None
        try:
            server = Server(argv, f"http://{HOST}:{port}", params.serve.api_key_env)
            server.wait_healthy(cfg.startup_timeout_s)
            yield server
        finally:
            if server is not None:
                server.stop(cfg.stop_timeout_s)


class Server:
    """One server process, leader of a process group of its own, its output in a temporary log file."""

    def __init__(self, argv: list[str], url: str, key_env: str):
        self.url, self.key_env = url, key_env
        fd, name = tempfile.mkstemp(prefix="serve_eval-", suffix=".log")
        self.log = Path(name)
        self.keep_log = False
        # PYTHONSAFEPATH: `python -m` would put the working directory first on sys.path, and in a checkout its
        # kernels/ folder is found for transformers' `import kernels` (the folder hands the name over, but
        # byte-compiling it changes a DVC dependency of train and evaluate)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONSAFEPATH": "1"}
        self.started = time.monotonic()
        self.startup_s: Optional[float] = None
        try:
            with os.fdopen(fd, "wb") as out:
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
        except BaseException:
            self.log.unlink(missing_ok=True)
            raise
        print(f"serve_eval: started the server (pid {self.proc.pid}, log {self.log}): {' '.join(argv)}", flush=True)

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once GET /health answers 200; UserError when the server exits first or after `timeout_s`."""
        key = os.environ.get(self.key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        deadline = self.started + timeout_s
        with httpx.Client(base_url=self.url, headers=headers, timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise self.failure("the server did not start")
                try:
                    if client.get("/health").status_code == 200:
                        self.startup_s = time.monotonic() - self.started
                        print(f"serve_eval: {self.url} healthy after {self.startup_s:.1f} s", flush=True)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise self.failure(f"the server did not answer GET {self.url}/health with 200 within "
                                       f"{timeout_s:g} s (serve_eval.startup_timeout_s)", show_log=True)
                time.sleep(POLL_S)

    def failure(self, why: str, show_log: bool = False, settle_s: float = 0.0) -> UserError:
        """-> UserError: `why`; when the server has exited (or `show_log`), how it stands and its log's tail (kept).
        `settle_s`: how long to wait for a dying server to become reapable (its sockets close before that)."""
        try:
            code = self.proc.wait(timeout=settle_s) if settle_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None and not show_log:
            return UserError(why)
        self.keep_log = True
        state = "was still running (stopped now)" if code is None else f"exited with {exit_status(code)}"
        tail = self.log.read_text(errors="replace")[-LOG_TAIL:] if self.log.exists() else ""
        return UserError(f"{why}\nThe server (pid {self.proc.pid}) {state}; its log {self.log} ends:\n{tail}")

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; return once the leader is reaped and no process of
        the group is left. Ctrl-C and SIGTERM are ignored meanwhile, so that a second one cannot cut the stop short."""
        group = self.proc.pid  # start_new_session: the leader's pid is the group's id
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            if not self._gone(group, 0):
                _signal_group(group, signal.SIGTERM)
                if not self._gone(group, grace_s):
                    print(f"serve_eval: the server ignored SIGTERM for {grace_s:g} s: SIGKILL", flush=True)
                    _signal_group(group, signal.SIGKILL)
                    if not self._gone(group, KILL_WAIT_S):
                        print(f"warning: processes {group_members(group)} of the server's group survive SIGKILL",
                              file=sys.stderr)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if not self.keep_log:
            self.log.unlink(missing_ok=True)

    def _gone(self, group: int, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the leader to exit (reaped here) and the group to empty -> whether it has."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None and not group_members(group):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def group_members(group: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group `group`: /proc where there is one, else a probe."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [group]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:  # every member exited meanwhile
        pass


def exit_status(code: int) -> str:
    """Popen.returncode -> 'code 2' or 'SIGKILL'-style words."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def free_port(host: str) -> int:
    """A TCP port nothing listens on now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextmanager
def interrupted_by_sigterm() -> Iterator[None]:
    """Within the block a SIGTERM of this process raises KeyboardInterrupt (as Ctrl-C does), so that the server
    is stopped on the way out; the previous handler afterwards. Main thread only (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
