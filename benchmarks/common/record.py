"""The record of a result: `environment` (date, command, device, versions, threads, the draft by name
and sha256), `device_name`, `draft_record`, `write_json`, `require_cuda`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import torch

def device_name(cuda: bool) -> str:
    """The GPU's name, or the CPU's (platform.processor, else the machine type)."""
    return torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine() or "cpu"


def draft_record(path: str | Path) -> dict[str, Any]:
    """A draft dir -> {draft: its name, draft_sha256: the sha256 of its weights}: the draft by name and
    content, not by the folder it was read from (a sharded draft: {file: sha256})."""
    from dominospec.files import sha256_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        digest: Any = sha256_file(files[0])
    else:
        digest = {f.name: sha256_file(f) for f in files} or None
    return {"draft": path.name, "draft_sha256": digest}


def environment(cuda: Optional[bool] = None, draft: Optional[str | Path] = None) -> dict[str, Any]:
    """Where a result came from: date, command, host, device, python / torch / transformers / triton /
    CUDA versions, torch's CPU threads, the host's load (1-minute average, and the CPUs: host-bound
    timings read against it), and with `draft` the draft by name and sha256 (`draft_record`;
    the command names it by name too, not by the folder it was read from). cuda None: whether a CUDA
    device is there."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    argv = [a.replace(str(draft), Path(draft).name) for a in sys.argv] if draft is not None else sys.argv
    out: dict[str, Any] = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                               command=shlex.join(argv), host=platform.node(), device=device_name(cuda),
                               python=platform.python_version(), torch=torch.__version__)
    for package in ("transformers", "triton"):
        try:
            out[package] = __import__(package).__version__
        except ImportError:
            out[package] = None
    out.update(cuda=torch.version.cuda, threads=torch.get_num_threads(), load_1min=os.getloadavg()[0], cpus=os.cpu_count())
    if draft is not None:
        out.update(draft_record(draft))
    return out


def write_json(path: str | Path, result: Any) -> None:
    """A result -> JSON at `path` (parents created; what JSON cannot hold written as str)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")


def require_cuda(hint: str = "use --smoke on CPU") -> None:
    """SystemExit unless a CUDA device is there."""
    if not torch.cuda.is_available():
        sys.exit(f"error: no CUDA device ({hint})" if hint else "error: no CUDA device")
