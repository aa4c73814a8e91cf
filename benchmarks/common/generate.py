"""transformers' own decoding as a baseline: `StaticGenerate` (HF `generate` with a static cache,
compiled on CUDA) and `until_stop` (generated tokens cut as the engine returns them).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StaticGenerate:
    """HF `generate` with a static cache; on CUDA, transformers compiles the decode step
    (torch.compile mode reduce-overhead: CUDA graphs). The cache is sized once by the warm-up on the
    longest prompt and kept: every call resets and reuses the same StaticCache, so the recorded graphs'
    static addresses (its K/V and its write counter) stay owned. Left to itself `generate` makes a new
    cache a call and frees the last, whose blocks the recorded graphs still point at
    (benchmarks/studies/compiled_generate_memory.py); `kept=False` does that, for the study."""

    def __init__(self, target: Any, stops: list[int], longest: list[int], max_new: int, kept: bool = True):
        from transformers import CompileConfig, StaticCache

        self.model, self.device, self.stops = target.model, target.device, stops
        self.cache = StaticCache(config=self.model.config, max_cache_len=len(longest) + max_new) if kept else None
        self.kwargs = dict(do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
                           compile_config=CompileConfig(fullgraph=False, mode="reduce-overhead"))
        if not kept:
            self.kwargs["cache_implementation"] = "static"
        tick = time.perf_counter()
        self(longest, max_new)  # compiles and records
        self(longest[: max(1, len(longest) // 2)], 16)
        self.warmup_s = time.perf_counter() - tick
        self.compiled = hasattr(self.model, "_compiled_call")  # set by transformers when it compiled

    def __call__(self, prompt: list[int], max_new: int) -> list[int]:
        """Prompt ids -> greedy new tokens (stop token included, as the engine returns them)."""
        ids = torch.tensor([prompt], device=self.device)
        if self.device.type == "cuda" and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()
        cache = {}
        if self.cache is not None:
            self.cache.reset()
            cache = {"past_key_values": self.cache}
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                  **cache, **self.kwargs)
        return until_stop(out[0, len(prompt):].tolist(), self.stops)


def until_stop(tokens: list[int], stops: Any) -> list[int]:
    """Generated tokens -> those up to and including the first stop token (as the engine returns them)."""
    cut = next((k + 1 for k, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:cut]
