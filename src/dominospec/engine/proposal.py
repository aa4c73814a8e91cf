"""One round's proposal, every token the target verifies after x_start under a parent row, and its verdict.

Row 0 of a verify is x_start; rows 1..N hold the proposed tokens, in parts: the draft's chain (a chain
under row 0), DominoTree's n nodes (a best-first tree), a prompt lookup (a chain under row 0, after the
draft's, or alone). A chain alone needs no mask (`shape` None: a causal verify); anything else carries
its `Tree` (engine.verify_shape). The `Verdict` is what the verify accepted: the round commits its
tokens on its rows, and the proposer books what each part would have accepted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dominospec.engine.accept import Accepted
from dominospec.engine.verify_shape import Tree, branch_tree


@dataclass(frozen=True)
class Part:
    """Rows first .. first + rows - 1 of a proposal, from one source: "draft" (the draft's chain)
    or "tree" (DominoTree's nodes), or "lookup" (a chain from the prompt)."""

    source: str
    first: int
    rows: int

    @property
    def span(self) -> range:
        return range(self.first, self.first + self.rows)


@dataclass(frozen=True)
class Proposal:
    """A round's rows to verify after x_start, and where they came from."""

    tokens: torch.Tensor  # [N] long (rows 1..N)
    parents: torch.Tensor  # [1 + N] long, row 0 its own (device)
    shape: Optional[Tree]  # the verify's Tree, None for one chain
    q: Optional[torch.Tensor]  # [N, V] float32: row r's token was drawn from q[r - 1] (None: point masses)
    parts: tuple[Part, ...]  # the sources of the rows, in order

    def of(self, source: str) -> list[Part]:
        return [p for p in self.parts if p.source == source]

    def count(self, source: str) -> int:
        """Proposed tokens from `source`."""
        return sum(p.rows for p in self.of(source))


def chains(pieces: Sequence[tuple[str, torch.Tensor]], x_start: torch.Tensor,
           q: Optional[torch.Tensor] = None) -> Proposal:
    """Chains under row 0, in order ((source, tokens [K]) each; empty ones dropped; none: a plain
    step) -> their Proposal. One chain verifies causally, several as branches (engine.verify_shape's
    cached shape: no host copy). `q` [K, V]: the draws of a chain alone (sampling verifies one chain)."""
    pieces = [(source, tokens) for source, tokens in pieces if tokens.numel()]
    parts, first = [], 1
    for source, tokens in pieces:
        parts.append(Part(source, first, tokens.numel()))
        first += tokens.numel()
    lengths = tuple(tokens.numel() for _, tokens in pieces)
    tokens = torch.cat([t for _, t in pieces]) if pieces else x_start[:0]
    shape = branch_tree(lengths, x_start.device) if len(pieces) > 1 else None
    return Proposal(tokens, branch_parents(lengths, x_start.device), shape, q if len(pieces) == 1 else None,
                    tuple(parts))


def best_first(tree, n: int, lookup: Optional[torch.Tensor]) -> Proposal:
    """DominoTree's best n nodes (engine.domino_tree.DraftTree), then a lookup chain [L] under row 0
    (or None) -> their Proposal (the tree's own bitmask, no host copy)."""
    L = 0 if lookup is None else lookup.numel()
    shape, parents = tree.verify_rows(n, L)
    tokens = torch.cat([tree.tokens[:n]] + ([lookup] if L else []))
    parts = tuple(p for p in (Part("tree", 1, n), Part("lookup", 1 + n, L)) if p.rows)
    return Proposal(tokens, parents, shape, None, parts)


@functools.lru_cache(maxsize=1024)
def branch_parents(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Parent rows [1 + sum(lengths)] of chains under row 0 (row 0 its own). Cached by shape (read-only)."""
    parents, first = [0], 1
    for length in lengths:
        parents += [0] + list(range(first, first + length - 1))
        first += length
    return torch.tensor(parents, dtype=torch.long).to(device)


@dataclass(frozen=True)
class Verdict:
    """What a verify accepted."""

    accepted: Accepted  # the path and the tokens to commit (engine.accept)
    features: Optional[torch.Tensor]  # the verify's target features [1, T, n*H] (None without a draft)
    proposal: Proposal  # what was verified

    @property
    def tokens(self) -> list[int]:
        """The accepted proposals, then the target's own next token (committed in this order)."""
        return self.accepted.tokens

    @property
    def rows(self) -> list[int]:
        """The verify rows of x_start and the accepted proposals, row 0 first."""
        return self.accepted.rows

    def path_in(self, part: Optional[Part]) -> list[int]:
        """The longest accepted path through `part`'s rows alone (greedy: whether or not it won; sampled:
        the rows of the drawn path in it); [] without the part."""
        if part is None:
            return []
        if self.accepted.walk is not None:
            return self.accepted.walk.path(part.span)
        return [r for r in self.rows[1:] if r in part.span]

    def winner(self) -> Optional[Part]:
        """The part the committed path runs through (the first when nothing was accepted)."""
        first = self.rows[1] if len(self.rows) > 1 else 1
        return next((p for p in self.proposal.parts if first in p.span), None)
