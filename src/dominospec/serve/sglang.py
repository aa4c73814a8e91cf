"""The SGLang backend: stock SGLang, in place of this process, on the exported draft (DFLASH + Domino head).

The command line itself is built below serve, with the export it launches
(dominospec.export.sglang_launch: `sglang_command`, `printable`), so that the model card shows the
very line `make serve` runs. Here: whether SGLang can run on this machine, and handing over to it.
SGLang runs only on CUDA: `sglang_available()` needs the package *and* a CUDA device.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from dominospec.export.sglang_launch import printable


def sglang_available() -> bool:
    """True when the `sglang` package is importable and torch sees a CUDA device (SGLang's DFLASH
    path runs on CUDA only). Nothing is imported from sglang."""
    import torch

    return importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()


def exec_sglang(argv: list[str]) -> None:
    """Replace this process by SGLang (signals, exit code and logs are SGLang's own). Never returns."""
    print(f"dominospec serve: {printable(argv)}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
