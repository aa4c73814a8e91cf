"""`dominospec serve`: choose the backend, then hand over to SGLang or run the built-in server.

Backends (`serve.backend`, or `--backend`):
  sglang   stock SGLang (`python -m sglang.launch_server ... --speculative-algorithm DFLASH`, see
           sglang.py); needs the `sglang` package (`pip install -e .[serve]`), a CUDA device and an
           HF target. It serves the draft as exported: `serve.mode` must be domino.
  builtin  dominospec's engine behind the same API subset (builtin.py): any machine, any target,
           modes domino | dflash | ar.
  auto     sglang when the package is importable, CUDA is available and `serve.mode` is domino;
           else builtin.
Host and port default to `serve.host` / `serve.port`. With SGLang the key in `serve.api_key_env`
is passed on as `--api-key` (SGLang reads it only from its command line).
"""

from __future__ import annotations

import os
from typing import Optional

from dominospec.errors import UserError
from dominospec.config import Params
from dominospec.serve.sglang import exec_sglang, sglang_available, sglang_command

BACKENDS = ("auto", "sglang", "builtin")


def resolve_backend(choice: str, mode: str) -> str:
    """'auto' | 'sglang' | 'builtin' (+ serve.mode) -> the backend that will run; UserError when impossible."""
    if choice not in BACKENDS:
        raise UserError(f"serve.backend: expected one of {list(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "sglang" if mode == "domino" and sglang_available() else "builtin"
    if choice == "sglang":
        if mode != "domino":
            raise UserError(f"serve.mode {mode!r} is built-in only: SGLang serves the draft as exported (use "
                            "--backend builtin, or serve.mode: domino)")
        if not sglang_available():
            raise UserError("backend sglang needs the `sglang` package (pip install -e '.[serve]') and a CUDA device; "
                            "use --backend builtin on this machine")
    return choice


def serve(params: Params, host: Optional[str] = None, port: Optional[int] = None, backend: Optional[str] = None) -> None:
    """Params (+ overrides) -> exec SGLang, or serve with the built-in server until interrupted."""
    cfg = params.serve
    host = cfg.host if host is None else host
    port = cfg.port if port is None else port
    chosen = resolve_backend(backend or cfg.backend, cfg.mode)
    if chosen == "sglang":
        exec_sglang(sglang_command(params, host, port, api_key=os.environ.get(cfg.api_key_env) or None))
    else:
        from dominospec.serve.builtin import run_builtin

        run_builtin(params, host, port)
