"""`engine.linear: auto`: pack the target's linears for oneDNN only where that is faster on this machine.

Whether packing pays depends on the CPU and on the rows: on the 2-core EPYC the packed 1-row step
was 1.8× faster than MKL's; on the 2-core Intel Xeon MKL's 1-row GEMV was the faster, while
packing still helps a multi-row verify, where MKL re-packs the weight on every call. So the choice
is made twice, on the target itself after a 64-token prefix in its KV cache: for the 1-row
forward (the AR step) and for an 8-row forward (a verify), each path the fastest of `repeats`,
packed and plain interleaved so that machine load hits both alike. The AR baseline, the verify
forward and the draft path (`EngineOptions.packed`) share the target's linears, so the
comparison between modes stays fair.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache

from dominospec.engine.kv import cache_argument, crop_kv
from dominospec.engine.packed import pack_linears, set_packed, unpack_linears

PREFIX, VERIFY_ROWS, REPEATS = 64, 8, 5
Timings = dict[tuple[int, bool], float]  # (rows, packed) -> ms


@torch.inference_mode()
def step_ms(model: Any, repeats: int = REPEATS) -> Timings:
    """-> ms of a forward of 1 and of 8 rows after the prefix, packed and plain, fastest of `repeats`."""
    vocab = int(model.config.vocab_size)
    ids = torch.arange(PREFIX + VERIFY_ROWS, device=model.device)[None] % vocab  # any tokens: cost does not depend on them
    cache = DynamicCache()
    arg = cache_argument(model)
    model(input_ids=ids[:, :PREFIX], **{arg: cache}, use_cache=True, logits_to_keep=1)
    best = {(rows, packed): float("inf") for rows in (1, VERIFY_ROWS) for packed in (True, False)}
    for _ in range(repeats):
        for rows, packed in best:
            set_packed(model, packed, packed)
            t0 = time.perf_counter()
            model(input_ids=ids[:, PREFIX:PREFIX + rows], **{arg: cache}, use_cache=True, logits_to_keep=rows)
            best[rows, packed] = min(best[rows, packed], 1000 * (time.perf_counter() - t0))
            crop_kv(cache, PREFIX)
    return best


def choose_linear(model: Any) -> tuple[str, Timings]:
    """Pack the model's linears, measure both paths for 1 and for 8 rows, keep the faster of each
    -> ("packed" when either row class packs, else "torch": unpacked again, the model as loaded;
    the timings). Nothing packable (a GPU, fp64): ("torch", {})."""
    if pack_linears(model) == 0:
        return "torch", {}
    timings = step_ms(model)
    one_row = timings[1, True] < timings[1, False]
    rows = timings[VERIFY_ROWS, True] < timings[VERIFY_ROWS, False]
    if not (one_row or rows):
        unpack_linears(model)
        return "torch", timings
    set_packed(model, one_row, rows)
    return "packed", timings
