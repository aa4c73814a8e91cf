"""CUDA graphs for the engine's fixed-shape forwards: capture once per shape, replay per round.

`ShapeGraphs(build)` holds one graph per shape key: `build(key)` returns a function of no arguments over
static input buffers, returning static outputs, warmed up on a side stream and captured; `run(key)`
replays it (the next replay of that key overwrites its outputs). With `enabled=False` `run` calls the
function eagerly; a shape whose capture fails runs eagerly from then on (`failures`). The runners hold
their own forwards' graphs; `DraftGraphs` is the one holder of the rest (the head's and the tree's).
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Hashable

import torch

from dominospec.errors import UserError

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
    """Fixed-size buffers whose rows 0..length-1 hold the sequence: `reset` and `crop` only move `length`."""

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


class DraftGraphs:
    """The one holder of the draft's graphs: the block's static inputs, z [B, H] and u [B, V] in the draft
    path's dtype, x_start [1] and the sampled chain's uniforms noise [B, V] float32 (made on first use),
    and one `ShapeGraphs` per function captured on them, by name (the head's greedy rollout, the sampled
    chain, the tree's build). `run` copies a block of K rows in and replays one; its outputs are valid
    until that function's next replay."""

    def __init__(self, block_size: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device,
                 enabled: bool):
        self.z = torch.zeros(block_size, hidden, dtype=dtype, device=device)
        self.base = torch.zeros(block_size, vocab, dtype=dtype, device=device)
        self.x_start = torch.zeros(1, dtype=torch.long, device=device)
        self._noise: Any = None
        self.enabled = enabled
        self.sets: dict[str, ShapeGraphs] = {}

    @property
    def noise(self) -> torch.Tensor:
        if self._noise is None:
            self._noise = torch.full(self.base.shape, 0.5, dtype=torch.float32, device=self.base.device)
        return self._noise

    def add(self, name: str, fn: Callable[..., Any]) -> None:
        """A set of graphs `name` of fn(z [K, H], u [K, V], x_start [1], *rest) over the inputs, one per (K, *rest)."""
        def build(key: tuple) -> Callable[[], Any]:
            K, rest = key[0], key[1:]
            return lambda: fn(self.z[:K], self.base[:K], self.x_start, *rest)

        self.sets[name] = ShapeGraphs(build, self.enabled)

    def run(self, name: str, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, *rest: Any) -> Any:
        """z [K, H], u [K, V], x_start [1] copied in -> the outputs of `name`'s graph of (K, *rest)."""
        K = z.shape[0]
        self.z[:K].copy_(z)
        self.base[:K].copy_(base_logits)
        self.x_start.copy_(x_start.reshape(1))
        return self.sets[name].run((K, *rest))

    def pool_workspace(self, pool_size: int) -> Any:
        """The kernels' pool selection buffers (kernels.pool_select.PoolWorkspace) for a pool of `pool_size`
        over the inputs' u, or None without a pool (one workspace for every K). The pool needs bf16, fp16
        or fp32 logits."""
        vocab, dtype = self.base.shape[1], self.base.dtype
        if not 0 < pool_size < vocab:
            return None
        from dominospec.kernels.pool_select import KEY_BITS, pool_workspace

        if dtype not in KEY_BITS:
            raise UserError(f"engine.candidate_pool with engine.head_kernel: triton selects the pool over "
                            f"bfloat16, float16 or float32 base logits, not {dtype} (set engine.draft_dtype)")
        return pool_workspace(vocab, pool_size, dtype, self.base.device)

    def failures(self) -> dict[str, str]:
        """Shapes whose capture failed (they run eagerly) -> the error, by name and key."""
        return {f"{name} {key}": err for name, graphs in self.sets.items() for key, err in graphs.failures.items()}
