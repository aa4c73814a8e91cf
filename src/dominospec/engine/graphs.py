"""CUDA graphs for the engine's fixed-shape forwards: capture once per shape, replay per round.

`ShapeGraphs(build)` holds one captured graph per shape key (the target's row count, the draft's
new context rows). `build(key)` returns a function of no arguments that reads only static input
buffers and returns static output tensors; it is run a few times on a side stream (warm-up:
cuBLAS workspaces, lazy allocations, Triton autotuning) and then captured. `run(key)` replays the
graph and returns its outputs, which the next replay of the same key overwrites: callers copy what
they keep.

With `enabled=False` (CPU, or `engine.cuda_graphs: off`) `run(key)` calls the function eagerly:
the same buffers and the same arithmetic, so the static-cache logic is testable without a GPU.
A shape whose capture fails (an op that synchronises, an old library) runs eagerly from then on,
and the failure is kept in `failures` for the caller to report.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Hashable

import torch

WARMUPS = 3


class ShapeGraphs:
    """key -> captured CUDA graph of `build(key)` (lazily, on first use), replayed by `run(key)`."""

    def __init__(self, build: Callable[[Hashable], Callable[[], Any]], enabled: bool):
        self.build, self.enabled = build, enabled
        self.functions: dict[Hashable, Callable[[], Any]] = {}
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.failures: dict[Hashable, str] = {}

    def run(self, key: Hashable, prepare: Callable[[], None] = lambda: None) -> Any:
        """Replay the graph of `key` (capturing it first when new) -> its static outputs.
        `prepare()` restores the state the graph reads (e.g. a cache length) before each warm-up
        and before the capture; the caller has already filled the input buffers."""
        if key not in self.functions:
            self.functions[key] = self.build(key)
        if not self.enabled or key in self.failures:
            return self.functions[key]()
        if key not in self.graphs:
            try:
                self.graphs[key] = capture(self.functions[key], prepare)
            except Exception:  # noqa: BLE001 - any capture failure falls back to eager for this shape
                self.failures[key] = traceback.format_exc(limit=4)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prepare()
                return self.functions[key]()
            prepare()
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs


def capture(fn: Callable[[], Any], prepare: Callable[[], None] = lambda: None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn -> (graph, its static outputs): `WARMUPS` side-stream runs, then one capture (not yet replayed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUPS):
            prepare()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    prepare()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


class FixedRows:
    """Fixed-size buffers whose rows 0..length-1 hold the sequence: `reset` and `crop` only move
    `length` (stale rows past it are masked by the reader and overwritten by the next write)."""

    what = "static cache"

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0

    def reset(self) -> None:
        self.length = 0

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a {self.what} of {self.length} rows to {n}")
        self.length = n

    def check_room(self, rows: int) -> None:
        if self.length + rows > self.capacity:
            raise ValueError(f"{self.what} full: {self.length} + {rows} rows > capacity {self.capacity}")
