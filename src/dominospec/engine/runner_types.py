"""What the round asks of its runners, as Protocols: the target's forwards on its KV cache and the draft's
block. Target runners: dynamic, static (transformers' forward on a StaticCache) and lean (models.lean);
draft runners: dynamic, static and lean. The round, the cost measurement and engine.runners see only these.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from dominospec.engine.verify_shape import Tree


@runtime_checkable
class TargetRunner(Protocol):
    """forward(ids [1, T], keep, tree) -> (logits [1, keep, V], features [1, T, n*H] or None), the rows
    appended after the `length` cached ones; `select(rows)` moves the last forward's rows into its
    first slots; `crop(n)` keeps positions 0..n-1; `reset()` empties it for a new generation."""

    @property
    def length(self) -> int: ...
    def reset(self) -> None: ...
    def forward(self, ids: torch.Tensor, keep: int,
                tree: Optional[Tree] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...
    def select(self, rows: list[int]) -> None: ...
    def crop(self, n: int) -> None: ...


@runtime_checkable
class DraftRunner(Protocol):
    """block(features [1, S, n*H] or None, x_start [1], start, K) -> (z [K, H], u [K, V]): the S new
    context rows appended, then the block at start..start+B-1; `extend(features)` appends only;
    `crop(n)` keeps context rows 0..n-1; `reset()` empties it."""

    @property
    def length(self) -> int: ...
    def reset(self) -> None: ...
    def extend(self, features: torch.Tensor) -> None: ...
    def crop(self, n: int) -> None: ...
    def block(self, features: Optional[torch.Tensor], x_start: torch.Tensor, start: int,
              K: int) -> tuple[torch.Tensor, torch.Tensor]: ...
