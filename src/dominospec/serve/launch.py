"""`dominospec serve`: choose the backend, then hand over to SGLang or run the built-in server.

Backends (`serve.backend`, or `--backend`):
  sglang   stock SGLang (`python -m sglang.launch_server ... --speculative-algorithm DFLASH`, the line
           of dominospec.export.sglang_launch); needs the `sglang` package (`pip install -e .[serve]`),
           a CUDA device and an HF target. It serves the draft as exported: `serve.mode` must be domino.
  builtin  dominospec's engine behind the same API subset (builtin.py): any machine, any target,
           modes domino | dominotree | dflash | ar.
  auto     sglang when the package is importable, CUDA is available, `serve.mode` is domino and the
           target is an HF checkpoint (SGLang cannot load a GGUF one); else builtin.
Host and port default to `serve.host` / `serve.port`. With SGLang the key in `serve.api_key_env`
is passed on as `--api-key` (SGLang reads it only from its command line).

Which draft: `paths.draft`, as given. The `dominospec serve` command first points it at the MLflow
registry's champion when there is one (dominospec.cli, which sits above both serve and retrain);
the `serve_eval` stage serves the pipeline's own export.
"""

from __future__ import annotations

import os
from typing import Optional

from dominospec.config import Params, TargetParams
from dominospec.errors import UserError
from dominospec.export.sglang_launch import hf_target, sglang_command
from dominospec.serve.sglang import exec_sglang, sglang_available

BACKENDS = ("auto", "sglang", "builtin")


def resolve_backend(choice: str, mode: str, target: Optional[TargetParams] = None) -> str:
    """'auto' | 'sglang' | 'builtin' (+ serve.mode, + the target when known) -> the backend that will run;
    UserError when impossible."""
    if choice not in BACKENDS:
        raise UserError(f"serve.backend: expected one of {list(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        sglang = mode == "domino" and sglang_available() and (target is None or hf_target(target))
        return "sglang" if sglang else "builtin"
    if choice == "sglang":
        if mode != "domino":
            raise UserError(f"serve.mode {mode!r} is built-in only: SGLang serves the draft as exported (use "
                            "--backend builtin, or serve.mode: domino)")
        if not sglang_available():
            raise UserError("backend sglang needs the `sglang` package (pip install -e '.[serve]') and a CUDA device; "
                            "use --backend builtin on this machine")
    return choice


def serve(params: Params, host: Optional[str] = None, port: Optional[int] = None,
          backend: Optional[str] = None) -> None:
    """Params (+ overrides) -> exec SGLang, or serve `paths.draft` with the built-in server until interrupted."""
    cfg = params.serve
    host = cfg.host if host is None else host
    port = cfg.port if port is None else port
    chosen = resolve_backend(backend or cfg.backend, cfg.mode, params.target)
    if chosen == "sglang":
        exec_sglang(sglang_command(params, host, port, api_key=os.environ.get(cfg.api_key_env) or None))
    else:
        from dominospec.serve.builtin import run_builtin

        run_builtin(params, host, port)
