"""Fixtures for the SGLang-code tests: our exports (sglang_cases.py) and SGLang's view of every one
of them, computed once per session in one subprocess (sglang_view.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang_cases import BROKEN, HERE, ROLLOUT, export_tiny, real_draft, sglang_site, sglang_version


@pytest.fixture(scope="session")
def exports(tmp_path_factory) -> dict[str, Path]:
    """name -> export directory: tiny `domino` (B 8) and `dflash` (head off, B 4) exports, the
    BROKEN copies of `domino`, and `artifact` (the real export) when params.yaml's paths.draft holds one."""
    root = tmp_path_factory.mktemp("sglang_exports")
    dirs = {
        "domino": export_tiny(root / "domino", seed=3, block_size=8),
        "dflash": export_tiny(root / "dflash", seed=4, use_domino_head=False),
    }
    for name, (breakage, _) in BROKEN.items():
        dirs[name] = root / name
        shutil.copytree(dirs["domino"], dirs[name])
        breakage(dirs[name])
    if (real_draft() / "config.json").is_file():
        dirs["artifact"] = real_draft()
    return dirs


@pytest.fixture(scope="session")
def sglang_views(exports, tmp_path_factory) -> dict[str, dict]:
    """name -> SGLang's view of that export (sglang_view.py), one subprocess for all of them."""
    site = sglang_site()
    if not (site / "sglang" / "__init__.py").is_file():
        pytest.fail(f"SGLang's code is not installed at {site}: run `make sglang-ref` (`make test` does)")
    out = tmp_path_factory.mktemp("sglang_views")
    with socket.socket() as s:  # a free port for the one-process gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = {name: {"dir": str(d), "rollout": ROLLOUT if name in ("domino", "artifact") else None}
             for name, d in exports.items()}
    request = out / "request.json"
    request.write_text(json.dumps({"site": str(site), "out": str(out), "port": port, "cases": cases}))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)  # SGLang's code first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, str(HERE / "sglang_view.py"), str(request)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"sglang_view.py failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    assert (out / "version.txt").read_text() == sglang_version()
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in exports}
