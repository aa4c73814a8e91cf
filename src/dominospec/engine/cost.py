"""What a round costs on this machine, phase by phase, for auto-K (engine.policy.RoundCost).

On a prefilled prompt, on the engine's own runners (static caches and graphs when it uses them): the
verify of r = 1..R rows (R - 1: the widest round; a runner that pads r to a row bucket is timed once a
bucket), the draft block, a K_max chain and (DominoTree) the whole tree's build, `repeats` times,
interleaved, the fastest kept. The verify costs are fitted non-decreasing in r (`nondecreasing`): else
one quiet sample makes a wide fork look cheaper than a narrow lookup.
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
    """An engine's runners (reset, with room for the prompt and the widest verify), its draft path (None
    without a draft) and Decoding, a prompt's ids [T] -> RoundCost (ms, the minimum over `repeats`).
    `now()` reads the wall clock after the device's queued work. `shared`: another engine's cost on the
    same target and draft, whose verify (when as wide) and draft forward are taken as they are."""
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
    verify_ms = list(shared.verify[:R]) if shared is not None else nondecreasing(
        [min(verify[shapes[r]]) for r in range(1, R + 1)])
    draft = (shared.draft if shared is not None else min(draft_ms)) if drafter is not None else 0.0
    return RoundCost(verify=verify_ms, draft=draft, rollout_step=min(chain_ms) if chain_ms else 0.0,
                     tree_build=min(build_ms) if build_ms else 0.0)


def runner_shapes(kv, rows: int) -> dict[int, int]:
    """r = 1..rows -> the rows of the forward that verifies r: the smallest of the runner's `buckets`
    that holds r (without them, r itself)."""
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
