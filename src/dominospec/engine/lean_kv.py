"""The target's forwards on the lean decoder (engine.lean_decoder), as the engine runs them.

`LeanTargetKV` is a third runner beside engine.target_kv's two, with their interface:
`forward(ids [1, T], keep, tree=None) -> (logits [1, keep, V], features [1, T, n*H] or None)`,
`select(rows)`, `crop(n)`, `reset()`, `length`. Its KV cache is the decoder's own pair of
[layers, Hkv, capacity, D] tensors, written in place.

Every forward of 1..`max_rows` rows (<= 64) is one CUDA graph per T (engine.graphs) whose inputs
are static buffers: the ids, the rows' depths and their visibility bitmasks (a chain's by default,
a tree's copied in from its cached `Tree.bits`: no host work), and the write position `start`, a
device scalar. The attention reads only cache rows below start + T, so the cost of a forward follows
the context, not the capacity, and a verify of 64 tree rows costs what a chain of 64 does.
Longer forwards (the prompt) run eagerly as one causal chain.

`select(rows)` (a tree's winning branch into place) is one gather of every layer's rows at once,
four launches whatever the depth of the model.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dominospec.engine.fork import MAX_TREE_ROWS, Tree, chain_tree
from dominospec.engine.graphs import FixedRows, ShapeGraphs
from dominospec.engine.lean_decoder import LeanDecoder

Output = tuple[torch.Tensor, Optional[torch.Tensor]]


class LeanTargetKV(FixedRows):
    """Forwards on the lean decoder's cache of `capacity` rows; T <= `max_rows` rows replay a CUDA graph when `graphs`."""

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
        self.ids = {T: torch.zeros(T, dtype=torch.long, device=device) for T in range(1, max_rows + 1)}
        self.chains = {T: chain_tree(T, device) for T in range(1, max_rows + 1)}
        self.depth = {T: c.depth.clone() for T, c in self.chains.items()}  # graph inputs
        self.bits = {T: c.bits.clone() for T, c in self.chains.items()}
        self.holds_chain = {T: True for T in self.chains}  # depth/bits[T] hold the chain's: a chain forward copies nothing
        self.workspaces = {T: decoder.stack.workspace_for(T, device) for T in self.chains}  # the attention's scratch per T
        self.graphs = ShapeGraphs(self._step, enabled=graphs)

    def forward(self, ids: torch.Tensor, keep: int, tree: Optional[Tree] = None) -> Output:
        T = ids.shape[1]
        self.check_room(T)
        self.start.fill_(self.length)
        self.first = self.length
        if T > self.max_rows:  # a prompt: one causal chain, eager
            if tree is not None:
                raise ValueError(f"a tree of {T} rows is over the lean verify's {self.max_rows}")
            depth = torch.arange(T, device=ids.device)
            logits, features = self.decoder.forward(ids[0], self.start, depth, None, self.keys, self.values, keep,
                                                    self.layer_ids, chain_start=self.length)
        else:
            self.ids[T].copy_(ids[0])
            if tree is not None or not self.holds_chain[T]:  # a tree, or the chain after one, rewrites the shape
                shape = tree or self.chains[T]
                self.depth[T].copy_(shape.depth)
                self.bits[T].copy_(shape.bits)
                self.holds_chain[T] = tree is None
            logits, features = self.graphs.run(T)
            logits = logits[T - keep:]
            features = features.clone() if features is not None else None  # the next replay overwrites it
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

    def _step(self, T: int):
        """T -> the graph's function: the forward of the static buffers of T rows at `start`."""
        return lambda: self.decoder.forward(self.ids[T], self.start, self.depth[T], self.bits[T], self.keys,
                                            self.values, T, self.layer_ids, workspace=self.workspaces[T])
