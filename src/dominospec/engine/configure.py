"""params -> the engine's options and sampling, and the target prepared once for every engine built on it."""

from __future__ import annotations

import os

import torch

from dominospec.config import EngineParams, EvaluateParams
from dominospec.engine.packed import pack_linears
from dominospec.engine.sampling import Sampling
from dominospec.engine.spec import EngineOptions
from dominospec.errors import UserError
from dominospec.target import DTYPES, Target


def engine_options(cfg: EngineParams) -> EngineOptions:
    """params.engine -> EngineOptions (the draft path packed too when `linear: packed`)."""
    graphs = cuda_graphs(cfg)
    return EngineOptions(
        draft_dtype=DTYPES[cfg.draft_dtype] if cfg.draft_dtype else None,
        packed=cfg.linear == "packed",
        candidate_pool=cfg.candidate_pool,
        confidence_cut=cfg.confidence_cut,
        ngram_min=cfg.ngram_min,
        ngram_max=cfg.ngram_max,
        ngram_num_draft=cfg.ngram_num_draft,
        ngram_assist=cfg.ngram_assist,
        acceptance_window=cfg.acceptance_window,
        head_kernel=head_kernel(cfg.head_kernel),
        static_cache=graphs,
        cuda_graphs=graphs,
        graph_capacity=cfg.graph_capacity,
    )


def cuda_graphs(cfg: EngineParams) -> bool:
    """engine.cuda_graphs -> whether the engine runs its forwards as CUDA graphs on static caches here."""
    if cfg.graph_capacity < 16:
        raise UserError(f"engine.graph_capacity must be >= 16 rows, got {cfg.graph_capacity}")
    if cfg.cuda_graphs == "on" and not torch.cuda.is_available():
        raise UserError("engine.cuda_graphs: on needs a CUDA GPU; set engine.cuda_graphs: auto or off on this machine")
    return cfg.cuda_graphs == "on" or (cfg.cuda_graphs == "auto" and torch.cuda.is_available())


def head_kernel(choice: str) -> str:
    """engine.head_kernel -> the same choice, once Triton can run it here (CUDA, or TRITON_INTERPRET=1 on CPU)."""
    if choice != "triton":
        return choice
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise UserError("engine.head_kernel: triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels "
                        "slowly on CPU); set engine.head_kernel: torch on this machine")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("engine.head_kernel: triton, but the triton package is not installed") from None
    return choice


def prepare_target(target: Target, cfg: EngineParams) -> int:
    """Pack the target's linears in place when `linear: packed` (before any engine is built, so the
    AR baseline and the verify forward run the same kernels) -> how many were packed."""
    return pack_linears(target.model) if cfg.linear == "packed" else 0


def sampling_from(cfg: EvaluateParams) -> Sampling:
    """evaluate params -> Sampling; a bad value raises UserError naming the key."""
    try:
        return Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    except ValueError as err:
        raise UserError(f"evaluate: {err}") from None
