"""The built-in server: dominospec's own engine behind SGLang's API subset, on any machine.

`run_builtin(params, host, port)`:
  1. binds the socket first (a busy port fails before the models load; port 0 = any free port,
     the line below names the one taken);
  2. loads the target (`params.target`) and, in modes dflash / domino / dominotree, the draft from
     `draft_dir(params.paths)` (the export, else checkpoints/final), refused when it was made for
     another target; builds a `SpecEngine` with K = `serve.num_draft` (null: B-1);
  3. starts the engine worker thread, prints one line

         dominospec serve: <name> (<mode>, B=<block_size>, K=<num_draft>) on http://<host>:<port>

     and serves with uvicorn until SIGINT / SIGTERM (in-flight requests get 5 s to finish).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from dominospec import __version__
from dominospec.errors import UserError
from dominospec.config import Params, ServeParams

if TYPE_CHECKING:
    from dominospec.serve.service import Service


def check_serve_params(cfg: ServeParams) -> None:
    """Range checks params.yaml's types cannot express; UserError naming `serve.<key>`."""
    problems = []
    if not 0 <= cfg.port <= 65535:
        problems.append(f"serve.port must lie in 0..65535 (0 = any free port), got {cfg.port}")
    for key in ("max_queue", "max_body_bytes", "max_prompt_tokens", "max_tokens_limit", "default_max_tokens"):
        if getattr(cfg, key) < 1:
            problems.append(f"serve.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.default_max_tokens > cfg.max_tokens_limit:
        problems.append(f"serve.default_max_tokens ({cfg.default_max_tokens}) exceeds serve.max_tokens_limit "
                        f"({cfg.max_tokens_limit})")
    for key in ("num_draft", "num_threads"):
        value = getattr(cfg, key)
        if value is not None and value != "auto" and value < 1:
            problems.append(f"serve.{key} must be >= 1{', auto' if key == 'num_draft' else ''} or null, got {value}")
    if not cfg.api_key_env:
        problems.append("serve.api_key_env must name an environment variable")
    if problems:
        raise UserError("; ".join(problems))


def bind(host: str, port: int) -> socket.socket:
    """(host, port) -> a bound TCP socket (not yet listening); UserError when the address is taken or invalid."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, socket.gaierror) as err:
        raise UserError(f"serve.host: cannot use {host!r}: {err}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_builtin(params: Params, host: str, port: int) -> None:
    """Params + address -> serve until interrupted (see the module docstring)."""
    import uvicorn

    from dominospec.serve.app import build_app

    check_serve_params(params.serve)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    try:
        service = load_service(params)
        app = build_app(service)
    except BaseException:
        sock.close()
        raise
    service.worker.start()
    sock.listen(2048)  # from here on connections queue until uvicorn accepts them
    info = service.info
    shape = f"B={info['block_size']}, K={info['num_draft']}" if service.speculative else "no draft"
    print(f"dominospec serve: {service.name} ({info['mode']}, {shape}) on {url(host, port)}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, lifespan="off", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        service.worker.stop()
        sock.close()


CALIBRATION_PROMPT = "Explain in two sentences what a hash table is."  # any chat prompt: only its length matters


def load_service(params: Params) -> "Service":
    """Params -> target, draft, engine and its (not yet started) worker, wrapped as a Service."""
    import torch

    from dominospec.data.chat import render_prompt
    from dominospec.draft import draft_dir, load_draft
    from dominospec.engine import SpecEngine
    from dominospec.runtime.prepare import prepare_target
    from dominospec.serve.requests import sampling_defaults
    from dominospec.serve.service import Service
    from dominospec.serve.worker import EngineWorker
    from dominospec.target import load_target

    cfg = params.serve
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    path = None if cfg.mode == "ar" else draft_dir(params.paths)
    if path is not None and not (path / "config.json").is_file():  # before minutes of target loading
        raise UserError(f"paths.draft: no draft at {params.paths.draft} (nor at {path}): run `dvc repro export`, "
                        "or serve the target alone with serve.mode: ar")
    target = load_target(params.target)
    draft = None if path is None else load_draft(path, target)
    linear = prepare_target(target, params.engine)  # the same kernels for every request, spec or not
    engine = SpecEngine(target, draft, cfg.mode, cfg.num_draft if draft is not None else None,
                        dataclasses.replace(params.engine, linear=linear))
    engine.capture_all()  # on CUDA graphs: every shape captured before the first request
    if engine.auto:  # auto-K's round cost, measured at start-up on a warm process, not inside the first request
        ids = render_prompt(target.tokenizer, [{"role": "user", "content": CALIBRATION_PROMPT}],
                            params.target.chat_template_kwargs)
        engine.calibrate(ids)  # the first pass warms every shape's kernels and allocations: a cold one overprices rows
        engine.calibrate(ids)
    name = cfg.served_model_name or target.identity.name
    api_key = os.environ.get(cfg.api_key_env) or None
    return Service(
        worker=EngineWorker(engine, cfg.max_queue), tokenizer=target.tokenizer,
        chat_template_kwargs=params.target.chat_template_kwargs, name=name, limits=cfg,
        sampling_defaults=sampling_defaults(getattr(target.model, "generation_config", None)),
        context_length=engine.max_positions, info=static_info(params, engine, name, path, api_key is not None),
        speculative=draft is not None, api_key=api_key,
    )


def static_info(params: Params, engine: Any, name: str, path: Any, auth: bool) -> dict[str, Any]:
    """The part of /server_info fixed at start-up."""
    spec = engine.draft is not None
    cfg = params.serve
    return {
        "backend": "builtin",
        "version": __version__,
        "started": int(time.time()),
        "served_model_name": name,
        "mode": cfg.mode,
        "speculative_algorithm": ("DOMINOTREE" if engine.mode == "dominotree" else "DFLASH") if spec else None,
        # SGLang's meaning: the verify window, anchor/bonus slot included (K + 1; = B by default; a tree's N + 1)
        "speculative_num_draft_tokens": (engine.nodes or engine.num_draft) + 1 if spec else None,
        "block_size": engine.block_size if spec else None,
        "num_draft": engine.num_draft if spec else None,
        "target": engine.target.identity.as_dict(),
        "draft": {"path": str(path), "domino_head": bool(engine.draft.config.use_domino_head)} if spec else None,
        "context_length": engine.max_positions,
        "limits": {key: getattr(cfg, key) for key in
                   ("max_queue", "max_body_bytes", "max_prompt_tokens", "max_tokens_limit", "default_max_tokens")},
        "api_key_required": auth,
    }
