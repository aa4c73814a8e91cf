"""The target's attention on CPU: grouped-query heads read their shared keys and values in place.

transformers' `sdpa` copies every layer's keys and values to all query heads (`repeat_kv`) for a masked
forward of several rows: every verify. `grouped_sdpa` hands torch's SDPA the key/value heads as they are
(`enable_gqa=True`): equal to the repeated path to the bit for several rows, within rounding for one
(docs/journal/2026-12-02-attention-without-repeated-keys-the-verify-on-the-cpu.md). Off CPU, and for what
it does not cover, transformers' `sdpa` runs. `gqa_sdpa` and `gqa_one_query` hold the grouped-head math
(regenerate.kv_batch uses them too). `use_grouped_sdpa(model)` selects it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "dominospec_grouped_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key/value [B, H_kv, S, D], mask [B, 1, T, S] (bool or additive) or None
    -> (attention output [B, T, H, D], None), as transformers' attention functions return it."""
    T, S = query.shape[2], key.shape[2]
    causal = attention_mask is None and T > 1 and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if not _covers(query, key, attention_mask, causal, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = gqa_sdpa(query, key, value, attention_mask, scaling, causal, dropout)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def gqa_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
             scaling: Optional[float], causal: bool = False, dropout: float = 0.0) -> torch.Tensor:
    """query [B, H, T, D], key/value [B, H_kv, S, D] (H a multiple of H_kv), mask [B, 1, T, S] or None
    -> [B, H, T, D]: torch's SDPA mapping each query head to its key/value head in place (no repeat)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          is_causal=causal, enable_gqa=query.shape[1] > key.shape[1])


def gqa_one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """query [R, H, 1, d], key/value [R, kv, C, d] (contiguous), additive mask [R, 1, 1, C] -> [R, 1, H, d].

    The G = H / kv query heads sharing a kv head are the rows of one batched matmul against the
    cached keys (no repeat of K/V); on the CPU it is several times faster than torch's flash kernel
    for one query (regenerate's batched decoder steps every slot with it)."""
    rows, heads, _, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    grouped = query.reshape(rows * kv_heads, groups, dim)  # [R*kv, G, d]
    mask = mask.expand(rows, kv_heads, 1, columns).reshape(rows * kv_heads, 1, columns)  # [R*kv, 1, C]
    keys_t = key.reshape(rows * kv_heads, columns, dim).transpose(1, 2)  # [R*kv, d, C]
    scores = torch.baddbmm(mask, grouped, keys_t, alpha=scaling)  # [R*kv, G, C]
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    out = torch.bmm(probs, value.reshape(rows * kv_heads, columns, dim))  # [R*kv, G, d]
    return out.reshape(rows, 1, heads, dim)


def _covers(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
            kwargs: dict[str, Any]) -> bool:
    """Whether `grouped_sdpa` computes this call itself: CPU, grouped heads, a mask shared by all
    heads or a causal prefill over no cache, and none of sdpa's extras (position bias, softcap)."""
    if query.device.type != "cpu" or query.shape[1] == key.shape[1]:
        return False
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    if mask is None:
        return not causal or query.shape[2] == key.shape[2]
    return mask.shape[1] == 1


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa gets (and a 4-D mask passed through)


def use_grouped_sdpa(model: Any) -> bool:
    """Switch `model` from `sdpa` to `grouped_sdpa` (idempotent) -> whether it now uses it."""
    current = model.config._attn_implementation
    if current == NAME:
        return True
    if current != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
