"""A tiny served project, and `dominospec serve` as a real process, for the serve tests.

`tiny_project(root, **serve)` -> params path: the tiny Llama target of tests/cache (6 layers, H 32,
V 300, 1024 positions, word-level tokens `t0..t299`) saved with a toy chat template, a random
Domino draft (B = 4) trained-looking for it and written into `paths.draft` by the export stage's
writer, and the repo's params with paths under `root` and `serve` overrides.
`ServerProcess(params, log).start()` runs `python -m dominospec.cli serve --params P --port 0`,
waits for its ready line (which names the port taken), and `stop()` terminates (then kills) it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator, Optional

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
from engine_helpers import CHAT_TEMPLATE  # noqa: E402
from export_helpers import BLOCK, save_checkpoint, save_tiny_target, target_params, write_export_params  # noqa: E402

# The served project of conftest.py: a bearer key, one queue slot, small limits.
KEY_ENV, KEY = "DOMINOSPEC_TEST_KEY", "sesame-open"
NAME = "tiny-domino"
# The default `domino` drafts DominoTree (engine.tree.shape best_first): SGLang's window is its N + 1 rows
NODES = yaml.safe_load((REPO / "params.yaml").read_text())["engine"]["tree"]["nodes"]
SERVE = dict(max_queue=1, max_body_bytes=65536, max_prompt_tokens=256, max_tokens_limit=1000, default_max_tokens=16,
             api_key_env=KEY_ENV, served_model_name=NAME, num_threads=1)
CHATS = [[{"role": "user", "content": "t5 t17 t42"}],
         [{"role": "system", "content": "t9"}, {"role": "user", "content": "t100 t7"},
          {"role": "assistant", "content": "t8 t8"}, {"role": "user", "content": "t250"}]]
PROMPTS = ["t5 t6 t7", "t200 t13 t13 t99"]

READY = re.compile(r"dominospec serve: (?P<name>\S+) \((?P<shape>[^)]*)\) on (?P<url>http://\S+)")


def export_draft(checkpoint: Path, draft_dir: Path) -> Path:
    """A `save_pretrained` draft -> the SGLang export directory, through the export stage's writer."""
    from dominospec.export.checkpoint import read_checkpoint
    from dominospec.export.hf import export_config, export_tensors, write_draft_dir

    trained = read_checkpoint(checkpoint)
    exported = export_config(trained.config)
    write_draft_dir(draft_dir, exported, export_tensors(trained.tensors, exported))
    return draft_dir


def tiny_project(root: Path, **serve) -> Path:
    """root/{target, checkpoints/final, draft, params.yaml} -> the params path (see the module docstring)."""
    from transformers import AutoTokenizer

    from dominospec.target import load_target

    target_dir = save_tiny_target(root / "target", "llama")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target_dir)
    identity = load_target(target_params(target_dir)).identity.as_dict()  # after the template: it is hashed
    params = write_export_params(root / "params.yaml", target_dir, root)
    raw = yaml.safe_load(params.read_text())
    export_draft(save_checkpoint(root / "checkpoints" / "final", identity), Path(raw["paths"]["draft"]))
    raw["serve"].update(serve)
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    return params


class ServerProcess:
    """`dominospec serve` in a subprocess; output in `log` (a file: a full pipe would block it)."""

    def __init__(self, params: Path, log: Path, env: Optional[dict[str, str]] = None, args: tuple[str, ...] = (),
                 module: str = "dominospec.cli"):
        self.params, self.log, self.args, self.module = params, log, args, module  # module: run with `python -m`
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc: Optional[subprocess.Popen] = None
        self.url = self.name = self.shape = ""

    def start(self, timeout: float = 120) -> "ServerProcess":
        command = [sys.executable, "-m", self.module, "serve", "--params", str(self.params), "--port", "0",
                   *self.args]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.params.parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = READY.search(self.output())
            if ready:
                self.url, self.name, self.shape = ready["url"], ready["name"], ready["shape"]
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server was not ready after {timeout} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; always reaps the process."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


@contextmanager
def running_server(root: Path, serve: dict, env: Optional[dict[str, str]] = None,
                   module: str = "dominospec.cli") -> Iterator[ServerProcess]:
    """A tiny project under `root` with `serve` params, served by a real process (API key set)
    for the duration of the block; always stopped and reaped."""
    process = ServerProcess(tiny_project(root, **serve), root / "server.log", env={KEY_ENV: KEY, **(env or {})},
                            module=module)
    try:
        yield process.start()
    finally:
        process.stop()


@contextmanager
def authorised_client(server: ServerProcess, timeout: float = 60) -> Iterator[httpx.Client]:
    """An HTTP client on `server` that sends the API key."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout) as client:
        yield client


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """SSE response lines -> each `data:` payload: a parsed chunk, or the string "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


__all__ = ["BLOCK", "CHATS", "KEY", "KEY_ENV", "NAME", "NODES", "PROMPTS", "READY", "SERVE", "ServerProcess", "export_draft",
           "sse_events", "target_params", "tiny_project"]
