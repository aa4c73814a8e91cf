"""Files every stage writes or checks: content hashes, and writes that are never seen half done.

Invariant of every writer here: the destination holds either its old content or the complete new
content, never a partial file. New content goes to a temporary sibling (same directory, so the
final rename stays on one filesystem), is flushed, then renamed over the destination. A full disk
becomes a `UserError` naming the file and the free space, and leaves no temporary file behind.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dominospec.errors import UserError

CHUNK = 1 << 22  # 4 MiB reads when hashing
# The code a resumed stage would continue with: the package and its installed models and kernels
CODE_PACKAGES = ("dominospec", "dominospec.models", "dominospec.kernels")
TEMP_SUFFIX = ".tmp"  # write_atomic's temporary: `<name>.tmp` next to the destination


def sha256_file(path: str | Path) -> str:
    """File -> sha256 hex digest, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def source_digest(roots: dict[str, Path]) -> str:
    """{name: folder} -> 16 hex of sha256 over every `*.py` below each folder, by name, relative
    path and content (sorted; caches such as __pycache__ hold no .py files)."""
    digest = hashlib.sha256()
    for name, root in sorted(roots.items()):
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """source_digest of the installed code (CODE_PACKAGES). Every resume fingerprint (regenerate's
    journal, the cache manifest, train's run.json) includes it: work done by other code is redone,
    never continued, so a stage re-run after a code change gives what the new code computes."""
    roots = {}
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for i, folder in enumerate(spec.submodule_search_locations or []):
            roots[f"{name}:{i}"] = Path(folder)
    return source_digest(roots)


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def write_atomic(path: str | Path, data: bytes) -> None:
    """`data` -> `path` via `<path>.tmp` + fsync + rename (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TEMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(
                f"disk full while writing {path} ({len(data) / 2**20:.1f} MiB; "
                f"{free_bytes(path.parent) / 2**20:.1f} MiB free): free some space and re-run"
            ) from err
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """obj -> pretty JSON at `path` (keys sorted, trailing newline), atomically."""
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def temp_sibling(path: Path) -> Path:
    """A temporary path next to `path` for building a directory, cleared first (a leftover from a
    killed run is removed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    remove(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def replace_path(tmp: Path, path: Path) -> None:
    """Move the finished `tmp` (file or directory) to `path`, replacing what was there."""
    old = path.with_name(f".{path.name}.old")
    remove(old)
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    remove(old)


def remove(path: Path) -> None:
    """Delete a file, link or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
