"""The target prepared once for every engine built on it: its linears' kernels and, on CPU, its attention."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from dominospec.config import EngineParams
from dominospec.runtime.attention import use_grouped_sdpa
from dominospec.runtime.packed import pack_linears, unpack_linears
from dominospec.target import Target


def prepare_target(target: Target, cfg: EngineParams, timer: Optional[Callable[[], float]] = None) -> str:
    """Give the target's linears the kernels `engine.linear` asks for, in place, before any engine is
    built (the AR baseline and the verify then run the same ones) -> the choice, "packed" or "torch",
    which the engines take (`dataclasses.replace(cfg, linear=...)`). `auto` times a one-row forward both
    ways (`timer()`, default `one_row_seconds`) and keeps the faster, packed on a tie: which wins depends
    on the CPU (docs/journal/2026-12-01-the-cpu-default-end-to-end-make-repro-from-a-fresh-clone.md).
    On CPU the target also attends with `grouped_sdpa` (runtime.attention)."""
    if target.device.type == "cpu":
        use_grouped_sdpa(target.model)
    unpack_linears(target.model)  # from torch's kernels, whatever an earlier call chose (idempotent)
    if cfg.linear == "torch":
        return "torch"
    if not pack_linears(target.model):
        return "torch"  # nothing packable here (CUDA, fp64): torch's kernels either way
    if cfg.linear == "packed":
        return "packed"
    timer = timer or (lambda: one_row_seconds(target))
    packed = timer()
    unpack_linears(target.model)
    plain = timer()
    if packed <= plain * AUTO_TIE:
        pack_linears(target.model)
        return "packed"
    return "torch"


AUTO_TIE = 1.02  # auto keeps the packed kernels unless torch's are faster by more than this (timer noise)


def one_row_seconds(target: Target, repeats: int = 5) -> float:
    """The fastest of `repeats` one-row forwards of the target (no cache; after one warm-up)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    best = float("inf")
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            target.model(input_ids=ids, use_cache=False)
            if i:
                best = min(best, time.perf_counter() - start)
    return best
