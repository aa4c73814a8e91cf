"""The draft as one engine runs it, loaded once: `load_draft_path(draft, target, decoding) -> DraftPath`.

The caller's draft (checked by the resolve step) in `Decoding.draft_dtype`, its linears packed for oneDNN
when asked (a copy when either changes anything: the caller's draft is shared by other engines); the LM
head that gives u = lm_head(z) [K, V], alike; the block's MASK embeddings [B-1, H]; what proposes from a
block: the head (engine.draft_head) and, on DominoTree, the grower (engine.domino_tree), their graphs on
the one holder (engine.graphs.DraftGraphs; static caches only).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dominospec.engine.decoding import Decoding
from dominospec.engine.domino_tree import TreeGrower
from dominospec.engine.draft_head import DraftHead, draft_head
from dominospec.engine.graphs import DraftGraphs
from dominospec.runtime.packed import linear_for, pack_linears
from dominospec.models.domino import DFlashDraftModel
from dominospec.target import Target


@dataclass(frozen=True)
class DraftPath:
    """The draft as one engine runs it (module docstring)."""

    model: DFlashDraftModel  # in Decoding.draft_dtype
    lm_head: Any  # z [K, H] -> u [K, V]
    layer_ids: tuple[int, ...]  # the target layers whose features it reads
    mask_embeds: torch.Tensor  # [B-1, H] in the draft's dtype: the block's MASK slots
    head: DraftHead  # its proposal for a block
    grower: Optional[TreeGrower]  # DominoTree's build
    graphs: Optional[DraftGraphs]  # the holder of the head's and the tree's graphs (static caches only)


def load_draft_path(draft: DFlashDraftModel, target: Target, decoding: Decoding) -> DraftPath:
    """A draft for `target`, checked by the resolve step (engine.decoding) -> its DraftPath (module docstring)."""
    d, device = decoding, target.device
    model, lm_head = draft_model(draft.eval(), target.lm_head, d.draft_dtype, d.packed, d.kernels)
    graphs = DraftGraphs(d.block_size, int(draft.config.hidden_size), lm_head.weight.shape[0], d.draft_dtype, device,
                         d.graphs) if d.static else None
    head = draft_head(model, target.embed_tokens, d, graphs)
    grower = TreeGrower(model, target.embed_tokens, d.nodes, d.children, d.pool, kernels=d.kernels,
                        graphs=graphs) if d.tree else None
    mask = torch.full((d.block_size - 1,), int(draft.config.mask_token_id), device=device)
    with torch.inference_mode():
        mask_embeds = target.embed_tokens(mask).to(d.draft_dtype)  # [B-1, H]
    return DraftPath(model, lm_head, tuple(draft.config.target_layer_ids), mask_embeds, head, grower, graphs)


def draft_model(draft: DFlashDraftModel, lm_head: Any, dtype: torch.dtype, packed: bool,
                kernels: bool) -> tuple[DFlashDraftModel, Any]:
    """The draft and the target's LM head -> both in `dtype`, packed when asked: the caller's when
    nothing changes, copies otherwise."""
    if dtype == draft.fc.weight.dtype and not packed:
        return draft, lm_head
    draft = copy.deepcopy(draft).to(dtype)
    if draft.fc.weight.device.type == "cpu" and not kernels:
        draft.prefix_gru.float()  # the GRU cell in fp32 on CPU: faster than torch's bf16 mm there, as exact
    if packed:
        pack_linears(draft)
    return draft, linear_for(lm_head, dtype, packed)
