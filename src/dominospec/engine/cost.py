"""Measure what a round costs on this machine, phase by phase, for auto-K (engine.policy.RoundCost).

On a real prompt (prefilled once): the target forward over r = 1..R rows with the draft's features
(the verify of r - 1 proposed tokens; r = 1 is the plain step; R - 1 the most a round verifies: a
chain of K_max or a tree, a lookup beside it; a runner that pads r up to a row bucket is
timed once a bucket), the draft forward over the block with the base logits of K_max rows, a
K_max-step chain, and (DominoTree) the growth of the whole tree; each `repeats` times, the phases interleaved so that machine load hits them alike,
and the fastest kept (load only ever adds time: the minimum is the machine's own cost, and K does
not follow one descheduled sample). The measurement runs on the engine's own runners (static
caches and CUDA graphs when it uses them, so auto-K sees the round it will run), which the engine
passes in (engine.runners); they are cropped back after every measurement and reset by the next
generation.

A wider verify never costs less than a narrower one (the same weights stream, over more rows), so
the verify costs are fitted non-decreasing in r (`nondecreasing`: the least-squares isotonic fit,
pool-adjacent-violators). Without it one quiet sample at 10 rows makes a 10-row fork look cheaper
than a 7-row lookup, and auto-K's choices, and with them τ, follow the noise of the calibration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from dominospec.engine.decoding import Decoding
from dominospec.engine.policy import RoundCost
from dominospec.engine.runner_types import DraftRunner, TargetRunner
from dominospec.engine.sampling import Sampling

if TYPE_CHECKING:
    from dominospec.engine.draft_path import DraftPath

REPEATS = 5


@torch.inference_mode()
def measure_round_cost(kv: TargetRunner, drafter: Optional[DraftRunner], path: Optional[DraftPath],
                       decoding: Decoding, ids: torch.Tensor, now: Callable[[], float],
                       shared: Optional[RoundCost] = None, repeats: int = REPEATS) -> RoundCost:
    """An engine's runners (target KV, draft block or None; reset, with room for the prompt and the
    widest verify more), its draft path (engine.draft_path: the head's chain and the tree's build;
    None without a draft) and its Decoding, a prompt's ids [T] on the device -> RoundCost (ms,
    minimum over `repeats`): verify costs for 1..R rows (R: the widest verify, x_start included),
    chains of K_max.
    `now()` reads the wall clock after the device's queued work.

    `shared`: the cost another engine measured on the same target and draft (evaluate's modes side
    by side). Its verify costs (as many rows as this engine verifies) and draft forward are taken as
    they are, and only this engine's own chain step and tree build are measured: modes compared on the
    same prompts then choose their shapes from one measurement of the machine, not from two samples
    of its noise. A shared cost with fewer verify rows than this engine needs is measured afresh."""
    T, K, R = ids.numel(), decoding.k_max, decoding.max_verify + 1  # R: the most rows a verify has
    head, grower = (path.head, path.grower) if path is not None else (None, None)
    if shared is not None and len(shared.verify) < R:
        shared = None
    _, features = kv.forward(ids[None], keep=1)
    if drafter is not None:
        drafter.extend(features.to(decoding.draft_dtype))
    shapes = runner_shapes(kv, R)  # r -> the rows its forward runs (a lean runner pads to its bucket)
    verify = {r: [] for r in sorted(set(shapes.values()))}
    draft_ms, chain_ms, build_ms = [], [], []
    widest = max(verify) if verify else R
    tokens = ids.repeat(widest)[:widest]  # any real tokens will do: the cost does not depend on them
    x_start = ids[-1:]
    for _ in range(repeats):
        for r in verify if shared is None else ():
            t0 = now()
            kv.forward(tokens[:r][None], keep=r)
            verify[r].append(1000 * (now() - t0))
            kv.crop(T)
        if drafter is not None:
            t0 = now()
            z, base_logits = drafter.block(None, x_start, T, K)
            t1 = now()
            head.chain(z, base_logits, x_start, Sampling(), None, confidence=True)
            t2 = now()
            draft_ms.append(1000 * (t1 - t0))
            chain_ms.append(1000 * (t2 - t1) / K)
            if grower is not None:
                t3 = now()
                grower.grow(z, base_logits, x_start)
                build_ms.append(1000 * (now() - t3))
    if shared is not None:
        return RoundCost(verify=list(shared.verify[:R]), draft=shared.draft if drafter is not None else 0.0,
                         rollout_step=min(chain_ms) if chain_ms else 0.0,
                         tree_build=min(build_ms) if build_ms else 0.0)
    return RoundCost(verify=nondecreasing([min(verify[shapes[r]]) for r in range(1, R + 1)]),
                     draft=min(draft_ms) if draft_ms else 0.0,
                     rollout_step=min(chain_ms) if chain_ms else 0.0,
                     tree_build=min(build_ms) if build_ms else 0.0)


def runner_shapes(kv, rows: int) -> dict[int, int]:
    """r = 1..rows -> the rows of the forward that verifies r: the smallest of the runner's graph
    buckets that holds r (its `buckets`; a runner without them runs every r as it is). Only those
    shapes are timed, so a runner of 264 rows times its ~30 buckets, not 264 forwards."""
    buckets = [B for B in getattr(kv, "buckets", ()) if B <= getattr(kv, "max_rows", 0)]
    return {r: next((B for B in buckets if B >= r), r) for r in range(1, rows + 1)}


def nondecreasing(values: list[float]) -> list[float]:
    """-> the non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of runs pooled to their mean
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]
