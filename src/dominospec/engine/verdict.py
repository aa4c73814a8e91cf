"""What one verify accepted, whatever the proposal (engine.proposal): the round commits its tokens on
its rows, and the proposer books what each of its parts would have accepted (engine.proposers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dominospec.engine.accept import Accepted
from dominospec.engine.proposal import Part, Proposal


@dataclass(frozen=True)
class Verdict:
    """accepted: the path and the tokens to commit (engine.accept); features: the verify's target
    features [1, T, n*H] (None without a draft), rows as the verify's; proposal: what was verified."""

    accepted: Accepted
    features: Optional[torch.Tensor]
    proposal: Proposal

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
