"""A Domino / DFlash draft's backbone on the lean decoder's fused ops (modeling_lean's `LeanStack`): the
context rows' append and the block's forward, for the engine's lean draft runner (engine.draft_block).

One cache [layers, Hkv, capacity + B, D] (the caller's) holds the context rows' keys and values (target
features -> fc -> hidden_norm -> k/v) at 0..start-1 and the block's own B rows after them (overwritten by
the next append, never committed); the block attends with `tree_attention` over both (a bitmask of B
ones). "Append S rows + block" is one pass: each layer projects the S context rows and the B block rows
in one q/k/v GEMM.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..domino import DFlashDraftModel
from ..domino.modeling_domino import rope_cos_sin
from .modeling_lean import DecoderOps, LeanStack, pack_layer


class LeanDraft:
    """A Domino / DFlash draft's backbone on the fused ops: context append and block forward. The
    draft's modules are left as they are; its fused q/k/v and gate/up are copies (models.lean)."""

    def __init__(self, draft: DFlashDraftModel, ops: DecoderOps):
        config = draft.config
        self.config, self.fc, self.hidden_norm = config, draft.fc.weight.detach(), draft.hidden_norm.weight.detach()
        self.stack = LeanStack(ops, [pack_layer(layer) for layer in draft.layers], draft.norm.weight.detach(),
                               int(config.num_attention_heads), int(config.num_key_value_heads), int(config.head_dim),
                               float(config.rms_norm_eps))
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> (cos, sin) [positions, D]
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown tables, which captured graphs still read

    def ensure_positions(self, n: int, dtype: torch.dtype) -> None:
        """The draft's rotary tables for positions 0..n-1 in `dtype` (models.domino's `rope_cos_sin`). Every
        engine on this draft shares them and CUDA graphs hold their addresses: outgrown tables are kept
        alive (`retired`), or a smaller cache's graph would read freed memory."""
        if dtype in self.tables and self.tables[dtype][0].shape[0] >= n:
            return
        positions = torch.arange(n, device=self.fc.device)[None]
        with torch.inference_mode():
            cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)  # [1, 1, n, D]
        if dtype in self.tables:
            self.retired.append(self.tables[dtype])
        self.tables[dtype] = (cos[0, 0], sin[0, 0])

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (within `ensure_positions`) -> (cos, sin) [T, D], two gathers."""
        cos, sin = self.tables[dtype]
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [S, n*H] -> the context rows' hidden states [S, H] (fc, then hidden_norm)."""
        stack = self.stack
        hidden, _ = stack.ops.rms_norm(F.linear(features.to(self.fc.dtype), self.fc), self.hidden_norm, stack.eps)
        return hidden

    def append(self, features: torch.Tensor, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Context rows [S, n*H] -> their K/V at cache rows (and positions) slot..slot+S-1 of every layer."""
        S, stack = features.shape[0], self.stack
        hidden = self.context_rows(features)
        cos, sin = self.rope(slot + torch.arange(S, device=slot.device), hidden.dtype)
        for i, layer in enumerate(stack.layers):
            stack.ops.rope_cache(F.linear(hidden, layer.qkv), cos, sin, keys[i], values[i], slot, stack.Hq, stack.Hkv,
                                 layer.q_norm, layer.k_norm, stack.eps)

    def block(self, embeds: torch.Tensor, slot: torch.Tensor, bits: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor, workspace: Any = None, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Block embeddings [B, H] at positions slot..slot+B-1 -> z [B, H] (the final norm's output).
        `features` [S, n*H]: context rows appended at slot-S..slot-1 in the same pass, their q/k/v in
        the block's GEMM (`LeanStack.run`'s context)."""
        S = 0 if features is None else features.shape[0]
        context = self.context_rows(features) if S else None
        cos, sin = self.rope(slot - S + torch.arange(S + embeds.shape[0], device=slot.device), embeds.dtype)
        return self.stack.run(embeds, cos, sin, keys, values, slot, bits, workspace=workspace, context=context)
