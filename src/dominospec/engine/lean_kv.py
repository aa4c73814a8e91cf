"""The lean decoder's forward (models.lean) for a `StaticTargetKV` (engine.target_kv): `LeanForward`, on the
decoder's own [layers, Hkv, capacity, D] cache, written in place.

Its row buckets (`row_buckets`: every T to 16, then padded to 24, 32, .. 64, 80, .. 128, 160, .. 320,
about 30 graphs, not 320); the rows' visibility as bitmask words (`Tree.bits`). The attention reads only
rows below start + T, so a forward costs what its context does, not the capacity. Forwards longer than
`max_rows` (the prompt) run eagerly as one causal chain.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dominospec.cache.tap import FeatureTap
from dominospec.engine.verify_shape import MAX_TREE_ROWS, Tree, pack_bits
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
