"""The target's forwards on its KV cache (the `TargetRunner` Protocol, engine.runner_types):
forward(ids [1, T], keep, tree) -> (logits [1, keep, V], features [1, T, n*H] or None), the rows
appended after the `length` cached ones, at positions length + depth (a chain without a tree).

- `DynamicTargetKV`: transformers' `DynamicCache`, grown and cropped (runtime.kv), eager.
- `StaticTargetKV`: a cache of `capacity` rows written in place by its forward, `HFForward`
  (transformers' `StaticCache`, the rows' visibility [T, T] bool) or `LeanForward` (the lean decoder,
  models.lean, on its own [layers, Hkv, capacity, D] cache: bitmask rows, `Tree.bits`; row buckets
  `row_buckets`, every T to 16, then padded to 24, 32, .. 64, 80, .. 128, 160, .. 320, about 30
  graphs, not 320; its attention reads only rows below start + T, so a forward costs what its context
  does, not the capacity). T <= `max_rows` rows replay their row bucket's CUDA graph over static inputs (ids,
  depths, visibility, the write position `start`); a padded row sees only itself and writes past the
  real rows. The prompt runs eagerly. Crop moves `length` only: later rows are masked, then overwritten.
transformers >= 5.2x writes at a per-layer tensor counter (`cumulative_length`), older releases at
`cache_position`: `HFForward` sets both from `start` inside the graph.
"""

from __future__ import annotations

import inspect
from bisect import bisect_left
from typing import Any, Optional, Sequence

import torch
from transformers import DynamicCache

from dominospec.cache.tap import FeatureTap
from dominospec.engine.graphs import FixedRows, ShapeGraphs
from dominospec.engine.verify_shape import MAX_TREE_ROWS, Tree, chain_tree, pack_bits
from dominospec.models.lean import LeanDecoder
from dominospec.runtime.kv import cache_argument, crop_kv, kv_length, layer_tensors

Output = tuple[torch.Tensor, Optional[torch.Tensor]]


def move_rows(tensors: list[torch.Tensor], start: int, rows: list[int]) -> None:
    """Rows start + rows[i] -> start + i along dim 2, for i in order, in every cache tensor [.., .., rows, D]
    (a fork's or a tree's winning path into place; rows ascending, rows[i] >= i). The caller crops after."""
    if rows == list(range(len(rows))):
        return
    source = torch.tensor([start + r for r in rows], device=tensors[0].device)
    for tensor in tensors:
        tensor[:, :, start:start + len(rows)] = tensor.index_select(2, source)


class DynamicTargetKV:
    """Eager forwards on a growing `DynamicCache`."""

    def __init__(self, model: Any, layer_ids: Sequence[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.cache_arg = cache_argument(model)
        self.cache = DynamicCache()
        self.start = 0  # first position the last forward wrote

    def reset(self) -> None:
        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return kv_length(self.cache)

    def forward(self, ids: torch.Tensor, keep: int, tree: Optional[Tree] = None) -> Output:
        self.start = self.length
        kwargs = {}
        if tree is not None:  # explicit positions and a 4-D mask [1, 1, T, cached + T], True = attend
            T = ids.shape[1]
            cached = torch.ones(T, self.start, dtype=torch.bool, device=ids.device)
            kwargs = {"position_ids": (self.start + tree.depth)[None],
                      "attention_mask": torch.cat([cached, tree.mask()], dim=1)[None, None]}
        tap = FeatureTap(self.layer_ids)
        with tap.hooked(self.model):
            out = self.model(input_ids=ids, **{self.cache_arg: self.cache}, use_cache=True, logits_to_keep=keep,
                             **kwargs)
        return out.logits, tap.features()

    def select(self, rows: list[int]) -> None:
        move_rows(layer_tensors(self.cache), self.start, rows)

    def crop(self, n: int) -> None:
        crop_kv(self.cache, n)


class StaticTargetKV(FixedRows):
    """Forwards of `forward` (`HFForward` or `LeanForward`) on its cache of `capacity` rows;
    T <= `max_rows` rows replay the CUDA graph of their row bucket when `graphs` (module docstring)."""

    what = "static KV cache"

    def __init__(self, forward: Any, layer_ids: Sequence[int], capacity: int, max_rows: int, graphs: bool):
        super().__init__(capacity)
        self.fwd, self.layer_ids, self.max_rows = forward, list(layer_ids), max_rows
        device = forward.device
        self.buckets = forward.bind(capacity, max_rows)  # the row counts that have a graph, the last max_rows
        self.start = torch.zeros((), dtype=torch.long, device=device)  # cache row of this forward's row 0
        self.first = 0  # the same, on the host (select)
        self.ids = {B: torch.zeros(1, B, dtype=torch.long, device=device) for B in self.buckets}
        self.chains = {B: (c.depth, forward.visibility(c)) for B in self.buckets for c in [chain_tree(B, device)]}
        self.depth = {B: depth.clone() for B, (depth, _) in self.chains.items()}  # graph inputs
        self.visible = {B: visible.clone() for B, (_, visible) in self.chains.items()}
        self.holds_chain = dict.fromkeys(self.buckets, True)  # the inputs hold the chain's: a chain copies nothing
        self.graphs = ShapeGraphs(self._step, enabled=graphs)

    def forward(self, ids: torch.Tensor, keep: int, tree: Optional[Tree] = None) -> Output:
        T = ids.shape[1]
        at = bisect_left(self.buckets, T)
        B = self.buckets[at] if at < len(self.buckets) else None  # the row bucket; None: a prompt, eager
        self.check_room(T if B is None else B)  # padded rows write past the real ones
        self.start.fill_(self.length)
        self.first = self.length
        if B is None:
            logits, features = self.fwd.prefill(self, ids, keep, tree)
        else:
            self.ids[B][:, :T].copy_(ids)
            self.load_shape(B, T, tree)
            logits, features = self.graphs.run(B)  # [1, B, V], [1, B, n*H] or None
            logits = logits[:, T - keep:T]
            features = features[:, :T].clone() if features is not None else None  # the next replay overwrites it
        self.length += T
        return logits, features

    def load_shape(self, B: int, T: int, tree: Optional[Tree]) -> None:
        """Bucket B's graph inputs <- the depths and visibility of the chain of T rows or of `tree`, rows
        T..B-1 each seeing itself alone; copied only when they change."""
        if tree is None and B == T:
            if not self.holds_chain[B]:
                self.depth[B].copy_(self.chains[B][0])
                self.visible[B].copy_(self.chains[B][1])
                self.holds_chain[B] = True
            return
        depth, visible = (tree.depth, self.fwd.visibility(tree)) if tree is not None else \
            (self.chains[B][0][:T], self.chains[B][1][:T])
        if B > T:
            self.depth[B].zero_()
            self.visible[B].copy_(self.fwd.alone[B])
        self.depth[B][:T].copy_(depth)
        self.visible[B][:T, :visible.shape[1]].copy_(visible)
        self.holds_chain[B] = False

    def select(self, rows: list[int]) -> None:
        move_rows(self.fwd.tensors(), self.first, rows)

    def _step(self, B: int):
        """B -> the graph's function: the forward of bucket B's static inputs at `start`."""
        return lambda: self.fwd.rows(self, self.ids[B], self.depth[B], self.visible[B])


class HFForward:
    """transformers' forward on a `StaticCache`, a `StaticTargetKV`'s: a row bucket for every T, the
    rows' visibility [T, T] bool, masked over all `capacity` columns."""

    def __init__(self, model: Any):
        self.model, self.device = model, next(model.parameters()).device
        self.cache_arg = cache_argument(model)
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.alone: dict = {}  # no padded rows

    def bind(self, capacity: int, max_rows: int) -> list[int]:
        """The cache of `capacity` rows -> the row buckets: every T <= max_rows."""
        from transformers import StaticCache

        self.cache = StaticCache(config=self.model.config, max_cache_len=capacity)
        self.columns = torch.arange(capacity, device=self.device)  # [L]
        return list(range(1, max_rows + 1))

    @staticmethod
    def visibility(tree: Tree) -> torch.Tensor:
        return tree.mask()

    def tensors(self) -> list[torch.Tensor]:
        return layer_tensors(self.cache)

    def prefill(self, kv: StaticTargetKV, ids: torch.Tensor, keep: int, tree: Optional[Tree]) -> Output:
        tree = tree or chain_tree(ids.shape[1], self.device)
        return self.rows(kv, ids, tree.depth, tree.mask(), keep)

    def rows(self, kv: StaticTargetKV, ids: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor,
             keep: Optional[int] = None) -> Output:
        """ids [1, T] at positions start + depth [T], visible [T, T] -> logits [1, keep (T), V], features;
        only tensor ops on static buffers (capturable)."""
        T, start = ids.shape[1], kv.start
        positions = start + depth  # [T]
        for counter in self._counters():
            counter.copy_(start)
        rel = self.columns - start  # [L]: column -> row of this forward (< 0: cached before it)
        own = visible.gather(1, rel.clamp(0, T - 1)[None, :].expand(T, -1))  # [T, L]
        mask = ((rel < 0)[None, :] | (own & (rel < T)[None, :]))[None, None]  # [1, 1, T, L], True = attend
        kwargs = {self.cache_arg: self.cache, "position_ids": positions[None], "attention_mask": mask,
                  "use_cache": True, "logits_to_keep": T if keep is None else keep}
        if self.takes_cache_position:
            kwargs["cache_position"] = positions
        tap = FeatureTap(kv.layer_ids)
        with tap.hooked(self.model):
            out = self.model(input_ids=ids, **kwargs)
        return out.logits, tap.features()

    def _counters(self) -> list[torch.Tensor]:
        """The per-layer write counters of transformers >= 5.2x (none on older releases)."""
        return [layer.cumulative_length for layer in getattr(self.cache, "layers", [])
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]


EXACT_ROWS = 16  # forwards of up to this many rows have graphs of their own (no padding)


def row_buckets(max_rows: int) -> list[int]:
    """The row counts that get a graph, ascending, the last `max_rows`: 1..16, then steps of 8 to 64,
    of 16 to 128, of 32 beyond (a padded row costs at most 1/8 .. 1/4 of the real ones)."""
    buckets, rows = [], 1
    while rows < max_rows:
        buckets.append(rows)
        rows += 1 if rows < EXACT_ROWS else 8 if rows < 64 else 16 if rows < 128 else 32
    return buckets + [max_rows]


class LeanForward:
    """The lean decoder's forward, a `StaticTargetKV`'s: padded row buckets, visibility as bitmask rows
    [T, words_for(T)] int64, at most MAX_TREE_ROWS rows a forward."""

    def __init__(self, decoder: LeanDecoder):
        self.decoder, self.device = decoder, decoder.device

    def bind(self, capacity: int, max_rows: int) -> list[int]:
        """The cache of `capacity` rows -> the row buckets (`row_buckets`)."""
        if max_rows > MAX_TREE_ROWS:
            raise ValueError(f"the lean decoder verifies at most {MAX_TREE_ROWS} rows a forward, asked for {max_rows}")
        self.decoder.ensure_positions(capacity)
        self.keys, self.values = self.decoder.new_cache(capacity)  # [layers, Hkv, capacity, D] each
        buckets = row_buckets(max_rows)
        self.alone = {B: pack_bits(torch.eye(B, dtype=torch.bool, device=self.device)) for B in buckets}  # padded rows
        self.workspaces = {B: self.decoder.stack.workspace_for(B, self.device) for B in buckets}  # attention scratch
        return buckets

    @staticmethod
    def visibility(tree: Tree) -> torch.Tensor:
        return tree.bits

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def prefill(self, kv: Any, ids: torch.Tensor, keep: int, tree: Optional[Tree]) -> Output:
        """A prompt ids [1, T]: one causal chain, eager."""
        T = ids.shape[1]
        if tree is not None:
            raise ValueError(f"a tree of {T} rows is over the lean verify's {kv.max_rows}")
        tap = FeatureTap(kv.layer_ids)
        logits = self.decoder.forward(ids[0], kv.start, torch.arange(T, device=ids.device), None, self.keys,
                                      self.values, keep, tap, chain_start=kv.length)
        features = tap.features()
        return logits[None], None if features is None else features[None]

    def rows(self, kv: Any, ids: torch.Tensor, depth: torch.Tensor, bits: torch.Tensor) -> Output:
        """ids [1, B] at positions start + depth [B], bits [B, words_for(B)] -> logits [1, B, V], features."""
        B = ids.shape[1]
        tap = FeatureTap(kv.layer_ids)
        logits = self.decoder.forward(ids[0], kv.start, depth, bits, self.keys, self.values, B, tap,
                                      workspace=self.workspaces[B])
        features = tap.features()
        return logits[None], None if features is None else features[None]
