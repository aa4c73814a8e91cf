"""The draft as one engine runs it, loaded once: `load_draft_path(draft, target, mode, ...) -> DraftPath`.

The caller's draft is checked against the target (engine.loading) and the mode, then put on the
draft path:
- the model in `engine.draft_dtype` (the target's dtype when unset), its linears packed for oneDNN
  with `engine.linear: packed` (engine.packed); a copy when either changes anything, since the
  caller's draft is shared by other engines;
- the LM head that gives its base logits u = lm_head(z) [K, V], in the same dtype and packing;
- the block's MASK embeddings [B-1, H] and the target layers whose features it reads;
- what proposes from a block (z [K, H], u [K, V]): the head's rollout (engine.draft_head: the
  model's, its Triton kernels, or their CUDA graphs), and in `dominotree` the tree grower
  (engine.domino_tree), their graphs on the engine's static caches (engine.runners.static_caches).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dominospec.config import EngineParams
from dominospec.engine.configure import head_kernel
from dominospec.engine.domino_tree import MAX_TREE_NODES, TreeGrower
from dominospec.engine.draft_head import DraftHead, draft_head
from dominospec.engine.loading import check_draft_matches
from dominospec.engine.packed import linear_for, pack_linears
from dominospec.errors import UserError
from dominospec.models.domino import DFlashDraftModel
from dominospec.target import DTYPES, Target

HEAD_MODES = ("domino", "dominotree")  # the modes that run the Domino head


@dataclass(frozen=True)
class DraftPath:
    """model: the draft in `dtype`; lm_head: z [K, H] -> u [K, V]; block_size B; layer_ids: the target
    layers whose features it reads; mask_embeds [B-1, H] in `dtype`: the block's MASK slots; head: its
    proposal for a block; grower: DominoTree's build, or None."""

    model: DFlashDraftModel
    lm_head: Any
    dtype: torch.dtype
    block_size: int
    layer_ids: tuple[int, ...]
    mask_embeds: torch.Tensor
    head: DraftHead
    grower: Optional[TreeGrower]


def load_draft_path(draft: Optional[DFlashDraftModel], target: Target, mode: str, params: EngineParams,
                    static: bool, graphs: bool) -> DraftPath:
    """A draft for `target` in a draft mode -> its DraftPath (module docstring); UserError names what
    does not fit. `static`, `graphs`: the engine's static caches and CUDA graphs."""
    if draft is None:
        raise UserError(f"mode {mode!r} needs a draft model")
    check_draft_matches(draft.config, target)
    if mode in HEAD_MODES and not draft.config.use_domino_head:
        raise UserError(f"mode {mode!r} needs a draft trained with the Domino head "
                        "(config.use_domino_head is false)")
    device = target.device
    resolved = torch.empty(0, device=device).device  # "cuda" -> "cuda:0"
    if draft.fc.weight.device != resolved:
        raise UserError(f"draft is on {draft.fc.weight.device}, target on {device}: move it")
    kernel = head_kernel(params.head_kernel)  # checked: triton runs here
    dtype = DTYPES[params.draft_dtype] if params.draft_dtype else target.embed_tokens.weight.dtype
    model, lm_head = draft_model(draft.eval(), target.lm_head, dtype, params.linear == "packed", kernel)
    block_size = int(draft.config.block_size)
    if block_size < 2:
        raise UserError(f"draft block_size must be >= 2, got {block_size}")
    head = draft_head(model, target.embed_tokens, mode, kernel, params.candidate_pool, static, graphs, block_size,
                      dtype, device)
    grower = None
    if mode == "dominotree":
        grower = tree_grower(model, target.embed_tokens, params, block_size, lm_head.weight.shape[0], dtype, device,
                             graphs, kernel)
    mask = torch.full((block_size - 1,), int(draft.config.mask_token_id), device=device)
    with torch.inference_mode():
        mask_embeds = target.embed_tokens(mask).to(dtype)  # [B-1, H]
    return DraftPath(model, lm_head, dtype, block_size, tuple(draft.config.target_layer_ids), mask_embeds, head,
                     grower)


def draft_model(draft: DFlashDraftModel, lm_head: Any, dtype: torch.dtype, packed: bool,
                kernel: str) -> tuple[DFlashDraftModel, Any]:
    """The draft and the target's LM head -> both in `dtype`, packed when asked: the caller's when
    nothing changes, copies otherwise."""
    if dtype == draft.fc.weight.dtype and not packed:
        return draft, lm_head
    draft = copy.deepcopy(draft).to(dtype)
    if draft.fc.weight.device.type == "cpu" and kernel != "triton":
        draft.prefix_gru.float()  # the GRU cell in fp32 on CPU: faster than torch's bf16 mm there, as exact
    if packed:
        pack_linears(draft)
    return draft, linear_for(lm_head, dtype, packed)


def tree_grower(draft: DFlashDraftModel, embed_tokens: Any, params: EngineParams, block_size: int, vocab: int,
                dtype: torch.dtype, device: torch.device, graphs: bool, kernel: str) -> TreeGrower:
    """`engine.tree.nodes` / `children`, checked -> DominoTree's build on the draft path (on the
    kernels where `kernel`, the resolved `engine.head_kernel`, says so: engine.domino_tree)."""
    tree = params.tree
    if tree.nodes < 1 or tree.children < 1:
        raise UserError(f"engine.tree.nodes and engine.tree.children must be >= 1, got {tree.nodes} and {tree.children}")
    if tree.nodes > MAX_TREE_NODES:
        raise UserError(f"engine.tree.nodes is at most {MAX_TREE_NODES} (a verify of 1 + nodes + lookup "
                        f"rows), got {tree.nodes}")
    return TreeGrower(draft, embed_tokens, tree.nodes, tree.children, params.candidate_pool,
                      block_size, vocab, dtype, device, graphs=graphs, head_kernel=kernel)
