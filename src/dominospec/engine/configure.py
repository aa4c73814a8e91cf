"""params -> the engine's options and sampling, and the target prepared once for every engine built on it."""

from __future__ import annotations

from dominospec.config import EngineParams, EvaluateParams
from dominospec.engine.packed import pack_linears
from dominospec.engine.sampling import Sampling
from dominospec.engine.spec import EngineOptions
from dominospec.errors import UserError
from dominospec.target import DTYPES, Target


def engine_options(cfg: EngineParams) -> EngineOptions:
    """params.engine -> EngineOptions (the draft path packed too when `linear: packed`)."""
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
    )


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
