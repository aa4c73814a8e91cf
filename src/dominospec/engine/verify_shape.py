"""The shape of a verify forward: each row's depth and the rows it sees (`Tree`).

Row 0 is x_start at position `start`, every other row a proposed token at start + its depth, seeing the
committed context, itself and its ancestors. The proposal builds it, the runners take it as it is: one
chain (`chain_tree`: row i at depth i, seeing rows 0..i); branches under row 0 (`branch_tree`, a fork:
each branch gets the logits a chain of its own would, up to rounding); DominoTree's nodes, which write
their own bitmask (`pack_bits`, int64 words a row, the lean verify's format, up to MAX_TREE_ROWS rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


MAX_TREE_ROWS = 320  # rows of one lean verify: x_start, 256 tree nodes and a lookup chain fit (kernels.tree_attention)


@dataclass(frozen=True)
class Tree:
    """A verify of T rows; `visible` or `bits` may be None: `mask()` reads either."""

    depth: torch.Tensor  # [T] long: position = start + depth
    visible: Optional[torch.Tensor]  # [T, T] bool: row i attends to row j (always to itself)
    bits: Optional[torch.Tensor] = None  # [T, words_for(T)] int64: visible[i, j] as bit j % 64 of word j // 64

    @staticmethod
    def of(depth: torch.Tensor, visible: torch.Tensor) -> "Tree":
        """depth [T], visible [T, T] -> the Tree, its bitmask too (None past MAX_TREE_ROWS)."""
        return Tree(depth, visible, None if visible.shape[-1] > MAX_TREE_ROWS else pack_bits(visible))

    def mask(self) -> torch.Tensor:
        """visible [T, T] bool, unpacked from `bits` when the tree was built as a bitmask alone."""
        if self.visible is not None:
            return self.visible
        T = self.bits.shape[0]
        shifts = torch.arange(64, device=self.bits.device, dtype=torch.long)
        return ((self.bits[:, :, None] >> shifts) & 1).reshape(T, -1)[:, :T].bool()


def words_for(rows: int) -> int:
    """int64 words of a row's visibility bitmask over `rows` rows."""
    return -(-rows // 64)


def pack_bits(visible: torch.Tensor) -> torch.Tensor:
    """visible [R, T] bool (row r sees column j) -> [R, words_for(T)] int64, bit j % 64 of word j // 64
    set iff visible[r, j]. Tensor ops only (a graph can run it)."""
    R, T = visible.shape
    W = words_for(T)
    padded = torch.nn.functional.pad(visible.long(), (0, W * 64 - T))  # [R, W * 64]
    shifts = torch.arange(64, device=visible.device, dtype=torch.long)
    return (padded.view(R, W, 64) << shifts).sum(-1)  # disjoint bits: the sum is their OR


def chain_tree(T: int, device: torch.device) -> Tree:
    """T rows of one chain: row i at depth i, seeing rows 0..i (the causal mask)."""
    return Tree.of(torch.arange(T, device=device), torch.ones(T, T, dtype=torch.bool, device=device).tril())


def branch_tree(lengths: Sequence[int], device: torch.device) -> Tree:
    """Row 0, then one branch per length, in order -> their Tree. Cached by shape (read-only): no host ->
    device copy, which would wait for the GPU's queued work before the verify could launch."""
    return _branch_tree(tuple(lengths), torch.device(device))


@functools.lru_cache(maxsize=1024)
def _branch_tree(lengths: tuple[int, ...], device: torch.device) -> Tree:
    T = 1 + sum(lengths)
    branch = torch.zeros(T, dtype=torch.long)  # 0: row 0 (shared), b + 1: branch b
    depth = torch.zeros(T, dtype=torch.long)
    first = 1
    for b, length in enumerate(lengths):
        branch[first:first + length] = b + 1
        depth[first:first + length] = torch.arange(1, length + 1)
        first += length
    rows = torch.arange(T)
    same = (branch[:, None] == branch[None, :]) & (rows[None, :] <= rows[:, None])
    visible = same | (rows[None, :] == 0)  # every row sees row 0
    return Tree.of(depth.to(device), visible.to(device))
