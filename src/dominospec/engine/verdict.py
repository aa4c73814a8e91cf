"""What one verify accepted, whatever it verified: a chain, the draft's branches beside a prompt
lookup (engine.fork), or a DominoTree (engine.tree_round). The round commits `tokens` on `rows` and
books the counts (engine.stats, auto-K's acceptance models)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Verdict:
    """tokens: the accepted proposals, then the target's own next token (committed in this order).
    rows: the verify rows of x_start and the accepted proposals, row 0 first ([len(tokens)]).
    features: the verify's target features [1, T, n*H] (None without a draft), rows as the verify's.

    drafted: the draft's proposal, K tokens a branch (a DominoTree: its depth) over `branches`
    branches (0 without a draft forward; a tree: its verified nodes count as branches of one);
    lookup: the prompt-lookup tokens verified (L). Accepted: `n_chain` on the draft's first
    branch (its best guesses), `n_draft` on its best branch or path, `n_lookup` on the lookup.
    `winner`: the index of the proposal whose tokens were kept (branches first, then the lookup);
    `winner_rank`: 1-based rank of the draft branch that won with >= 1 token, 0 when none did.
    `branched`: several proposals were verified as a tree (greedy only). `draft_rows`: a
    DominoTree's accepted path in its own nodes (verify rows, root first), whichever path was kept."""

    tokens: list[int]
    rows: list[int]
    features: Optional[torch.Tensor]
    drafted: int = 0
    branches: int = 0
    lookup: int = 0
    n_chain: int = 0
    n_draft: int = 0
    n_lookup: int = 0
    winner: int = 0
    winner_rank: int = 0
    branched: bool = False
    draft_rows: tuple[int, ...] = ()

    @property
    def accepted(self) -> int:
        """Proposed tokens the target accepted (the next token is the target's own)."""
        return len(self.tokens) - 1
