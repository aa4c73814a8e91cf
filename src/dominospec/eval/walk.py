"""τ of the draft at a fixed K on the target's own answers: the engine walk (train.walk), in evaluate.

The engine's τ under `num_draft: auto` depends on the K that auto-K chose, and so on the machine's
load: the same weights can read τ far apart (journal). Walking the AR answer anchor by anchor at K = B - 1
instead gives the τ that greedy drafting at that K would reach. It equals the engine's τ at that K
up to feature numerics (tests/train/test_walk.py), does not depend on timing, and is the draft's
quality measure of the draft-quality study.

    walk_answer(draft, target, ids [T], loss_mask [T], heads) -> [WalkStats per head setting]
    walk_suite(draft, target, prompts, answers)                -> {"domino"/"dflash": τ ± SE, ...}
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dominospec.cache.features import target_hidden
from dominospec.train.walk import WalkStats, walk_sequence


@torch.no_grad()
def walk_answer(draft: Any, target: Any, ids: torch.Tensor, loss_mask: torch.Tensor, heads: Sequence[bool],
                chunk: int = 64) -> list[WalkStats]:
    """One sequence (prompt + answer, the answer's positions True in `loss_mask`) -> its engine walk at
    K = B - 1 for each head setting (True = Domino head, False = base logits), one target forward."""
    ids = ids.to(target.device)
    layer_ids = list(draft.config.target_layer_ids)
    feats = target_hidden(target.model, ids[None], torch.ones_like(ids)[None], layer_ids)[0].clone()  # [T, n*H]
    K = int(draft.config.block_size) - 1
    return [walk_sequence(draft, target.embed_tokens, target.lm_head, ids, loss_mask, feats, K, head=head, chunk=chunk)
            for head in heads]


def walk_suite(draft: Any, target: Any, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> dict:
    """Prompts and the target's greedy answers to them -> pooled walk τ ± SE and acceptance by position,
    with the head (`domino`, when the draft has one) and without (`dflash`)."""
    names = ["domino", "dflash"] if draft.config.use_domino_head else ["dflash"]
    totals = {name: WalkStats() for name in names}
    for prompt, answer in zip(prompts, answers):
        if len(answer) < 2:
            continue  # a one-token answer offers no round
        ids = torch.tensor(list(prompt) + list(answer))
        loss_mask = torch.zeros(ids.numel(), dtype=torch.bool)
        loss_mask[len(prompt):] = True
        for name, stats in zip(names, walk_answer(draft, target, ids, loss_mask, [n == "domino" for n in names])):
            totals[name].merge(stats)
    return {"num_draft": int(draft.config.block_size) - 1, **{name: s.as_dict() for name, s in totals.items()}}
