"""The Domino head prepared once for the Triton kernels (`dominospec.kernels`): draft (in the draft
path's dtype) + the target's embedding -> `HeadWeights`: W1 split at H, W2, and the GRU's input gates
either as a [V, 3G] table gathered by token id or, past `GRU_TABLE_BUDGET_BYTES`, as a GEMV per step.
triton is imported lazily: an engine on the torch path never imports it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dominospec.errors import UserError

# The [V, 3G] GRU input table replaces streaming W_ih (3G·H) every step. Qwen3-8B shapes: 0.93 GB
# in bf16, which fits; beyond 2 GiB the GEMV path is taken (it reads W_ih + one embedding row).
GRU_TABLE_BUDGET_BYTES = 2 << 30


def prepare_head_kernels(draft: Any, embed_tokens: Any) -> Any:
    """Domino draft + target embedding module -> `dominospec.kernels.head_rollout.HeadWeights` on the draft's device."""
    device = draft.embed_proj[2].weight.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(f"engine.head_kernel: triton runs on CUDA tensors, but the draft is on {device} "
                        "(set TRITON_INTERPRET=1 to run the kernels on CPU, or engine.head_kernel: torch)")
    from dominospec.kernels.head_rollout import head_weights

    gru = draft.prefix_gru
    with torch.no_grad():
        return head_weights(embed_tokens.weight, gru.weight_ih_l0, gru.weight_hh_l0, draft.embed_proj[0].weight,
                            draft.embed_proj[2].weight, draft.config.pure_draft_prefix_len, GRU_TABLE_BUDGET_BYTES)
