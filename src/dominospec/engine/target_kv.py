"""The target's forwards on its KV cache (the `TargetRunner` Protocol, engine.runner_types):
forward(ids [1, T], keep, tree) -> (logits [1, keep, V], features [1, T, n*H] or None), the rows
appended after the `length` cached ones, at positions length + depth (a chain without a tree).

- `DynamicTargetKV`: transformers' `DynamicCache`, grown and cropped (engine.kv), eager.
- `StaticTargetKV`: a `StaticCache` of `capacity` rows written in place with an explicit mask
  [1, 1, T, capacity] (the columns before `start`, and the tree's visible rows), one fixed shape per T:
  T <= `max_rows` replays a CUDA graph (engine.graphs), the tree an input buffer; the prefill is eager.
  Crop moves `length` only: rows past it are masked, then overwritten.
The write position: transformers >= 5.2x writes at a per-layer tensor counter (`cumulative_length`),
older releases at `cache_position`; each forward sets both from one device scalar (`start`) inside
the graph, so a replay never depends on what the previous one left.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch
from transformers import DynamicCache

from dominospec.cache.tap import FeatureTap
from dominospec.engine.graphs import FixedRows, ShapeGraphs
from dominospec.engine.kv import cache_argument, crop_kv, kv_length, move_rows
from dominospec.engine.verify_shape import Tree, chain_tree

Output = tuple[torch.Tensor, Optional[torch.Tensor]]


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
        move_rows(self.cache, self.start, rows)

    def crop(self, n: int) -> None:
        crop_kv(self.cache, n)


class StaticTargetKV(FixedRows):
    """Forwards on a `StaticCache` of `capacity` rows; T <= `max_rows` rows replay a CUDA graph when `graphs`."""

    what = "static KV cache"

    def __init__(self, model: Any, layer_ids: Sequence[int], capacity: int, max_rows: int, graphs: bool):
        from transformers import StaticCache

        super().__init__(capacity)
        self.model, self.layer_ids, self.max_rows = model, list(layer_ids), max_rows
        self.device = next(model.parameters()).device
        self.cache_arg = cache_argument(model)
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)
        self.columns = torch.arange(capacity, device=self.device)  # [L]
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # first position written
        self.first = 0
        self.buckets = list(range(1, max_rows + 1))  # the row counts that have a graph: every one
        self.ids = {T: torch.zeros(1, T, dtype=torch.long, device=self.device) for T in self.buckets}
        self.chains = {T: chain_tree(T, self.device) for T in self.buckets}
        self.trees = {T: Tree(c.depth.clone(), c.visible.clone()) for T, c in self.chains.items()}  # graph inputs (no bits: the mask is built from visible)
        self.holds_chain = {T: True for T in self.trees}  # trees[T] holds chains[T]: a chain forward copies nothing
        self.graphs = ShapeGraphs(self._step, enabled=graphs)

    def forward(self, ids: torch.Tensor, keep: int, tree: Optional[Tree] = None) -> Output:
        T = ids.shape[1]
        self.check_room(T)
        self.start.fill_(self.length)
        self.first = self.length  # the same, on the host (select)
        if T > self.max_rows:  # prefill: eager, one shape per prompt length
            logits, features = self._forward(ids, keep, tree or chain_tree(T, self.device))
        else:
            self.ids[T].copy_(ids)
            if tree is not None or not self.holds_chain[T]:  # only a fork, or the chain after one, rewrites the tree
                shape = tree or self.chains[T]
                self.trees[T].depth.copy_(shape.depth)
                self.trees[T].visible.copy_(shape.mask())
                self.holds_chain[T] = tree is None
            logits, features = self.graphs.run(T)
            logits = logits[:, T - keep:]
            features = features.clone() if features is not None else None  # the next replay overwrites it
        self.length += T
        return logits, features

    def select(self, rows: list[int]) -> None:
        move_rows(self.cache, self.first, rows)

    def _step(self, T: int):
        """T -> the graph's function: the forward of the static buffers `ids[T]`, `trees[T]` at `start`."""
        return lambda: self._forward(self.ids[T], T, self.trees[T])

    def _forward(self, ids: torch.Tensor, keep: int, tree: Tree) -> Output:
        """ids [1, T] at positions start + tree.depth -> logits [1, keep, V], features; only tensor
        ops on static buffers (capturable)."""
        T = ids.shape[1]
        positions = self.start + tree.depth  # [T]
        for counter in self._counters():
            counter.copy_(self.start)
        rel = self.columns - self.start  # [L]: column -> row of this forward (< 0: cached before it)
        own = tree.mask().gather(1, rel.clamp(0, T - 1)[None, :].expand(T, -1))  # [T, L]
        mask = ((rel < 0)[None, :] | (own & (rel < T)[None, :]))[None, None]  # [1, 1, T, L], True = attend
        kwargs = {self.cache_arg: self.cache, "position_ids": positions[None], "attention_mask": mask,
                  "use_cache": True, "logits_to_keep": keep}
        if self.takes_cache_position:
            kwargs["cache_position"] = positions
        tap = FeatureTap(self.layer_ids)
        with tap.hooked(self.model):
            out = self.model(input_ids=ids, **kwargs)
        return out.logits, tap.features()

    def _counters(self) -> list[torch.Tensor]:
        """The per-layer write counters of transformers >= 5.2x (none on older releases)."""
        return [layer.cumulative_length for layer in getattr(self.cache, "layers", [])
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
