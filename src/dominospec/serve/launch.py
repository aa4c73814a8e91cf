"""`dominospec serve`: choose the backend, then hand over to SGLang or run the built-in server.

Backends (`serve.backend`, or `--backend`):
  sglang   stock SGLang (`python -m sglang.launch_server ... --speculative-algorithm DFLASH`, see
           sglang.py); needs the `sglang` package (`pip install -e .[serve]`), a CUDA device and an
           HF target. It serves the draft as exported: `serve.mode` must be domino.
  builtin  dominospec's engine behind the same API subset (builtin.py): any machine, any target,
           modes domino | dominotree | dflash | ar.
  auto     sglang when the package is importable, CUDA is available and `serve.mode` is domino;
           else builtin.
Host and port default to `serve.host` / `serve.port`. With SGLang the key in `serve.api_key_env`
is passed on as `--api-key` (SGLang reads it only from its command line).

Which draft: the champion of the MLflow registry (`retrain.registered_model`, alias `champion`, set
by `dominospec retrain`) when the store has one, announced as `serving <model> version <N>
(champion)`; else `paths.draft`, as the pipeline left it. `champion=False` skips the registry.
"""

from __future__ import annotations

import dataclasses
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


def with_champion(params: Params) -> Params:
    """Params -> the same params with `paths.draft` at the registry's champion draft, when there is one."""
    from dominospec.retrain.registry import champion_draft

    champion = champion_draft(params)
    if champion is None:
        print(f"serving {params.paths.draft} (no champion in the registry {params.mlflow.tracking_uri})", flush=True)
        return params
    print(f"serving {champion.model} version {champion.version} (champion) from {champion.path}", flush=True)
    return dataclasses.replace(params, paths=dataclasses.replace(params.paths, draft=str(champion.path)))


def serve(params: Params, host: Optional[str] = None, port: Optional[int] = None, backend: Optional[str] = None,
          champion: bool = True) -> None:
    """Params (+ overrides) -> exec SGLang, or serve with the built-in server until interrupted."""
    cfg = params.serve
    host = cfg.host if host is None else host
    port = cfg.port if port is None else port
    chosen = resolve_backend(backend or cfg.backend, cfg.mode)
    if champion and cfg.mode != "ar":  # ar serves the target alone
        params = with_champion(params)
    if chosen == "sglang":
        exec_sglang(sglang_command(params, host, port, api_key=os.environ.get(cfg.api_key_env) or None))
    else:
        from dominospec.serve.builtin import run_builtin

        run_builtin(params, host, port)
