"""Timing: `median_ms`, `sync`, `capture` (a CUDA graph by the engine's own capture), `log`, `warm_up`,
`interleaved` (every prompt through every engine in turn, so all see the same machine drift),
`verify_costs` (a target runner's verify of T rows against its AR step, `tree_lengths`) and
`copy_bandwidth` (the rate that bounds a step streaming its weights).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

import torch

def log(msg: str) -> None:
    """A progress line, time-stamped, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def median_ms(fn: Callable, reps: int, cuda: bool, before: Callable = lambda: None, warmup: int = 3,
              events: bool = False) -> float:
    """Median ms of fn() over `reps` calls after `warmup` untimed ones; `before()` runs untimed before each.
    Wall time around a synchronised call, or with `events` on CUDA the device time (CUDA events) of each."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(reps):
        before()
        if cuda and events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            sync(cuda)
            t0 = time.perf_counter()
            fn()
            sync(cuda)
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def capture(fn: Callable, before: Callable = lambda: None) -> tuple[Callable, Any]:
    """fn -> (replay, static output): fn in one CUDA graph by the engine's own capture (engine.graphs:
    side-stream warm-ups first). The graph has not run yet: replay it before reading the output."""
    from dominospec.engine.graphs import capture as capture_graph

    graph, out = capture_graph(fn, before)
    return graph.replay, out


def tree_lengths(T: int) -> list[int]:
    """T rows -> branch lengths of a 4-branch tree sharing row 0 (a chain for T <= 2)."""
    drafts = T - 1
    if drafts < 2:
        return [drafts] if drafts else []
    width = min(4, drafts)
    return [drafts // width + (b < drafts % width) for b in range(width)]


def verify_costs(kv: Any, vocab: int, context: int, rows: list[int], reps: int, cuda: bool) -> dict:
    """A static target runner (engine.target_kv.StaticTargetKV) -> {T: {wall_ms, device_ms}}: what a round's verify of
    T rows costs at `context` cached rows, from launch to the host knowing the answer: the ids in, a tree of
    T rows (`tree_lengths`; T = 1 is the AR step), the forward, the argmax read (the round's one
    synchronisation), then the crop back (untimed). Medians of `reps` after 5 warm-ups; device_ms: CUDA
    events around the forward alone."""
    from dominospec.engine.verify_shape import branch_tree

    device = kv.start.device
    g = torch.Generator().manual_seed(0)
    kv.reset()
    kv.forward(torch.randint(3, vocab, (1, context), generator=g).to(device), keep=1)
    out = {}
    for T in rows:
        ids = torch.randint(3, vocab, (1, T), generator=g).to(device)
        lengths = tree_lengths(T)
        tree = branch_tree(lengths, device) if len(lengths) > 1 else None
        walls, device_ms = [], []
        for i in range(reps + 5):
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            tick = time.perf_counter()
            logits, _ = kv.forward(ids, keep=T, tree=tree)
            if cuda:
                b.record()
            logits[0].argmax(-1).tolist()  # the round's one read
            wall = time.perf_counter() - tick
            kv.crop(context)
            if i >= 5:
                walls.append(1000 * wall)
                if cuda:
                    device_ms.append(a.elapsed_time(b))
        out[T] = dict(wall_ms=sorted(walls)[len(walls) // 2],
                      device_ms=sorted(device_ms)[len(device_ms) // 2] if device_ms else None)
    return out


def copy_bandwidth(cuda: bool, gib: float = 2.0, reps: int = 20) -> float:
    """GB/s of a device-to-device copy of `gib` GiB, counting the bytes read and the bytes written (median
    of `reps`, CUDA events): the rate that bounds a step that streams its weights (on CPU: a memcpy)."""
    n = int(gib * 2**30) // 2
    device = "cuda" if cuda else "cpu"
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)  # random, never zeros
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, cuda, events=cuda)
    del src, dst
    return 2 * n * 2 / (ms / 1000) / 1e9


def warm_up(engines: dict[str, Any], prompt: list[int], new_tokens: int = 8) -> None:
    """One short generation per engine: allocations, kernel choice, auto-K's cost measurement."""
    for engine in engines.values():
        engine.generate(prompt, new_tokens)


def interleaved(engines: dict[str, Any], prompts: list[list[int]], new_tokens: int, sampling: Any = None,
                seed: Optional[int] = None, label: str = "prompt") -> dict[str, list[Any]]:
    """Every prompt through every engine in turn, so all see the same machine load -> {name: [Generation]}.
    With `sampling`, prompt i generates with seed `seed + i` in every engine. A progress line a prompt on stderr."""
    runs: dict[str, list[Any]] = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        for name, engine in engines.items():
            if sampling is None:
                runs[name].append(engine.generate(prompt, new_tokens))
            else:
                runs[name].append(engine.generate(prompt, new_tokens, sampling, seed=None if seed is None else seed + i))
        print(f"[{label} {i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
    return runs
