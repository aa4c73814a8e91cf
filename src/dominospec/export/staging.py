"""All-or-nothing outputs: write each next to its destination, move them all into place at the end.

    with Staging() as staging:
        d = staging.path_for(Path("artifacts/draft"))     # artifacts/.draft.tmp-xyz/draft
        ... write d ...
        staging.publish()                                  # artifacts/draft replaced
    # on an exception before publish(): nothing at the destinations changed, temp dirs removed

Each temp dir sits in its destination's parent, so the final moves are same-filesystem renames.
Files that land next to a staged path (e.g. an ONNX `<name>.data` sidecar) are published with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


class Staging:
    """Temp paths next to final outputs; `publish()` renames everything into place."""

    def __init__(self) -> None:
        self._staged: list[tuple[Path, Path]] = []  # (temp dir, destination parent)

    def path_for(self, final: Path) -> Path:
        """Destination path -> the temp path to write it to (same name, in a fresh temp dir beside it)."""
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        self._staged.append((tmp, final.parent))
        return tmp / final.name

    def publish(self) -> None:
        """Move every staged file or directory to its destination, replacing what is there."""
        for tmp, parent in self._staged:
            for item in sorted(tmp.iterdir()):
                _replace(item, parent / item.name)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc) -> None:
        for tmp, _ in self._staged:
            shutil.rmtree(tmp, ignore_errors=True)


def _replace(src: Path, dst: Path) -> None:
    """Rename src onto dst; an existing directory at dst is moved aside first, then deleted."""
    if dst.is_dir() and not dst.is_symlink():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        dst.rename(old)
        src.rename(dst)
        shutil.rmtree(old)
    else:
        os.replace(src, dst)
