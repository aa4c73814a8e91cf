"""The target's forwards on the lean decoder (models.lean): `LeanTargetKV`, a `TargetRunner`
(engine.runner_types) on the decoder's own [layers, Hkv, capacity, D] cache, written in place.

A forward of T <= `max_rows` (<= 320) rows replays the CUDA graph of its row bucket (`row_buckets`:
every T to 16, then padded to 24, 32, .. 64, 80, .. 128, 160, .. 320, about 30 graphs, not 320). The
graph's inputs are static buffers: the ids, the rows' depths and visibility bitmasks (a chain's, or a
tree's copied from its `Tree.bits`), and the write position `start`. A padded row sees only itself and
writes past the real rows, where the next forward overwrites it. The attention reads only rows below
start + T, so a forward costs what its context does, not the capacity. Longer forwards (the prompt)
run eagerly as one causal chain. `select(rows)` is one gather of every layer's rows at once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dominospec.cache.tap import FeatureTap
from dominospec.engine.graphs import FixedRows, ShapeGraphs
from dominospec.engine.verify_shape import MAX_TREE_ROWS, Tree, chain_tree, pack_bits
from dominospec.models.lean import LeanDecoder

Output = tuple[torch.Tensor, Optional[torch.Tensor]]


EXACT_ROWS = 16  # forwards of up to this many rows have graphs of their own (no padding)


def row_buckets(max_rows: int) -> list[int]:
    """The row counts that get a graph, ascending, the last `max_rows`: 1..16, then steps of 8 to 64,
    of 16 to 128, of 32 beyond (a padded row costs at most 1/8 .. 1/4 of the real ones)."""
    buckets, rows = [], 1
    while rows < max_rows:
        buckets.append(rows)
        rows += 1 if rows < EXACT_ROWS else 8 if rows < 64 else 16 if rows < 128 else 32
    return buckets + [max_rows]


class LeanTargetKV(FixedRows):
    """Forwards on the lean decoder's cache of `capacity` rows; T <= `max_rows` rows replay the CUDA
    graph of their row bucket when `graphs`."""

    what = "static KV cache"

    def __init__(self, decoder: LeanDecoder, layer_ids: Sequence[int], capacity: int, max_rows: int, graphs: bool):
        if max_rows > MAX_TREE_ROWS:
            raise ValueError(f"the lean decoder verifies at most {MAX_TREE_ROWS} rows a forward, asked for {max_rows}")
        super().__init__(capacity)
        self.decoder, self.layer_ids, self.max_rows = decoder, list(layer_ids), max_rows
        decoder.ensure_positions(capacity)
        device = decoder.device
        self.keys, self.values = decoder.new_cache(capacity)  # [layers, Hkv, capacity, D] each
        self.start = torch.zeros((), dtype=torch.long, device=device)  # cache row of this forward's row 0
        self.first = 0  # the same, on the host (select)
        self.buckets = row_buckets(max_rows)
        self.ids = {B: torch.zeros(B, dtype=torch.long, device=device) for B in self.buckets}
        self.chains = {B: chain_tree(B, device) for B in self.buckets}  # bits [B, words_for(B)]
        self.depth = {B: c.depth.clone() for B, c in self.chains.items()}  # graph inputs
        self.bits = {B: c.bits.clone() for B, c in self.chains.items()}
        self.alone = {B: _alone_bits(B, device) for B in self.buckets}  # padded rows: each sees itself only
        self.holds_chain = {B: True for B in self.buckets}  # depth/bits[B] hold the chain's: a chain copies nothing
        self.workspaces = {B: decoder.stack.workspace_for(B, device) for B in self.buckets}  # attention scratch per B
        self.graphs = ShapeGraphs(self._step, enabled=graphs)

    def bucket(self, T: int) -> int:
        """Rows T <= max_rows -> the rows of the graph that runs them."""
        return next(B for B in self.buckets if B >= T)

    def forward(self, ids: torch.Tensor, keep: int, tree: Optional[Tree] = None) -> Output:
        T = ids.shape[1]
        if T > self.max_rows:  # a prompt: one causal chain, eager
            if tree is not None:
                raise ValueError(f"a tree of {T} rows is over the lean verify's {self.max_rows}")
            self.check_room(T)
            self.start.fill_(self.length)
            self.first = self.length
            depth = torch.arange(T, device=ids.device)
            tap = FeatureTap(self.layer_ids)
            logits = self.decoder.forward(ids[0], self.start, depth, None, self.keys, self.values, keep, tap,
                                          chain_start=self.length)
            features = tap.features()
        else:
            B = self.bucket(T)
            self.check_room(B)  # the padded rows write past the real ones
            self.start.fill_(self.length)
            self.first = self.length
            self.ids[B][:T].copy_(ids[0])
            if B == T and tree is None:  # a whole bucket's chain
                if not self.holds_chain[B]:
                    self.depth[B].copy_(self.chains[B].depth)
                    self.bits[B].copy_(self.chains[B].bits)
                    self.holds_chain[B] = True
            else:  # a tree, or rows padded up to B: the real rows' shape over padded rows that see themselves
                depth, bits = (tree.depth, tree.bits) if tree is not None else (self.chains[B].depth[:T],
                                                                               self.chains[B].bits[:T])
                if B > T:
                    self.depth[B].zero_()
                    self.bits[B].copy_(self.alone[B])
                self.depth[B][:T].copy_(depth)
                self.bits[B][:T, :bits.shape[1]].copy_(bits)
                self.holds_chain[B] = False
            logits, features = self.graphs.run(B)
            logits = logits[T - keep:T]
            features = features[:T].clone() if features is not None else None  # the next replay overwrites it
        self.length += T
        return logits[None], None if features is None else features[None]

    def select(self, rows: list[int]) -> None:
        """The last forward's rows `rows` (ascending, rows[i] >= i) -> its first len(rows) slots, every layer at once."""
        if rows == list(range(len(rows))):
            return
        source = torch.tensor([self.first + r for r in rows], device=self.keys.device)
        span = slice(self.first, self.first + len(rows))
        for cache in (self.keys, self.values):  # [layers, Hkv, C, D]
            cache[:, :, span] = cache.index_select(2, source)

    def _step(self, B: int):
        """B -> the graph's function: the forward of the static buffers of B rows at `start`."""
        def step() -> Output:
            tap = FeatureTap(self.layer_ids)
            logits = self.decoder.forward(self.ids[B], self.start, self.depth[B], self.bits[B], self.keys, self.values,
                                          B, tap, workspace=self.workspaces[B])
            return logits, tap.features()
        return step


def _alone_bits(rows: int, device: torch.device) -> torch.Tensor:
    """[rows, words_for(rows)] int64: row i sees row i only."""
    return pack_bits(torch.eye(rows, dtype=torch.bool, device=device))
