"""Measure what a round costs on this machine, phase by phase, for auto-K (engine.policy.RoundCost).

On a real prompt (prefilled once): the target forward over r = 1..K_max+1 rows with the draft's
features (the verify of r-1 drafts; r = 1 is the plain step), the draft forward over the block with
the base logits of K_max rows, and a K_max-step chain; each `repeats` times, the phases
interleaved so that machine load hits them alike, and the fastest kept (load only ever adds time:
the minimum is the machine's own cost, and K does not follow one descheduled sample). Greedy
chain; the caches are cropped back after every measurement, so the engine's state is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from dominospec.engine.kv import crop_kv
from dominospec.engine.policy import RoundCost
from dominospec.engine.rollout import draft_chain
from dominospec.engine.sampling import Sampling
from dominospec.models.domino import DraftContextCache

if TYPE_CHECKING:
    from dominospec.engine.spec import SpecEngine

REPEATS = 5


@torch.inference_mode()
def measure_round_cost(engine: "SpecEngine", prompt: list[int], repeats: int = REPEATS) -> RoundCost:
    """Engine (spec mode) + prompt ids -> RoundCost (ms, minimum over `repeats`)."""
    ids = torch.tensor(prompt, device=engine.device)
    T, K = ids.numel(), engine.num_draft
    kv = DynamicCache()
    _, features = engine._target_forward(ids[None], kv, keep=1)
    context = None
    if engine.draft is not None:
        context = DraftContextCache(len(engine.draft.layers))
        engine.draft.extend_context(features.to(engine.draft_dtype), context)
    verify = {r: [] for r in range(1, K + 2)}
    draft_ms, chain_ms = [], []
    rows = ids[-(K + 1):].repeat(K + 1)[: K + 1]  # any real tokens will do: the cost does not depend on them
    x_start = ids[-1:]
    for _ in range(repeats):
        for r in verify:
            t0 = engine._now()
            engine._target_forward(rows[:r][None], kv, keep=r)
            verify[r].append(1000 * (engine._now() - t0))
            crop_kv(kv, T)
        if context is not None:
            state = _Probe(context)
            t0 = engine._now()
            z, base_logits = engine._draft_forward(state, x_start, T, K)
            t1 = engine._now()
            draft_chain(engine.draft, z, base_logits, x_start, engine.embed_tokens, Sampling(), None,
                        engine.mode == "domino", engine.options.candidate_pool, kernels=engine.head_kernels)
            t2 = engine._now()
            draft_ms.append(1000 * (t1 - t0))
            chain_ms.append(1000 * (t2 - t1) / K)
    return RoundCost(verify=[min(verify[r]) for r in verify],
                     draft=min(draft_ms) if draft_ms else 0.0,
                     rollout_step=min(chain_ms) if chain_ms else 0.0)


class _Probe:
    """The slice of the engine's per-generation state a draft forward reads: context, no pending rows."""

    def __init__(self, context: DraftContextCache):
        self.context, self.pending = context, []
