"""Target features: which layers, and one batched forward that returns their outputs.

Layer l is the output of decoder layer l, the raw residual stream (cache.tap, which collects the
outputs of the wanted layers). `target_hidden` runs the target's base model
(no LM head) and stops after the deepest layer needed; `target_hidden_and_next` (the cache) runs
the whole model and also returns the target's greedy next token at every position.
"""

from __future__ import annotations

from typing import Optional

import torch

from dominospec.cache.tap import FeatureTap
from dominospec.config import CacheParams
from dominospec.errors import UserError
from dominospec.target import default_layer_ids


def resolve_layer_ids(params: CacheParams, num_layers: int) -> list[int]:
    """cache params + target depth L -> the n layer ids whose outputs are cached, ascending.

    `params.layer_ids` when set, else `default_layer_ids(L, n)`. Every id must lie in 0..L-2:
    HF's last hidden state (index L) is taken after the final norm, not the residual stream.
    """
    n = params.num_feature_layers
    ids = list(params.layer_ids) if params.layer_ids is not None else default_layer_ids(num_layers, n)
    if len(ids) != n:
        raise UserError(f"cache.layer_ids has {len(ids)} entries but cache.num_feature_layers is {n}")
    if not ids or sorted(set(ids)) != ids:
        raise UserError(f"cache.layer_ids must be distinct and ascending, got {ids}")
    if ids[0] < 0 or ids[-1] > num_layers - 2:
        raise UserError(
            f"cache.layer_ids {ids} out of range for a {num_layers}-layer target: allowed 0..{num_layers - 2} "
            f"(hidden_states[{num_layers}] is after the final norm, not a layer output)"
        )
    return ids


def _run_capturing(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   layer_ids: list[int], stop: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The base model's forward with the outputs of `layer_ids` tapped -> (target_hidden
    [B, T, n*H], last hidden state [B, T, H] after the final norm, or None when `stop` cut the
    forward after the deepest tapped layer)."""
    tap, last = FeatureTap(layer_ids), None
    with tap.hooked(model, stop=stop):
        last = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return tap.features(), last  # [B, T, n*H], [B, T, H] | None


@torch.inference_mode()
def target_hidden(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> torch.Tensor:
    """input_ids [B, T], attention_mask [B, T] (1 = real, right padding) -> target_hidden [B, T, n*H].

    Rows at padded positions hold whatever the target computed there; callers drop them.
    """
    return _run_capturing(model, input_ids, attention_mask, layer_ids, stop=True)[0]


@torch.inference_mode()
def target_hidden_and_next(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int],
    chunk_rows: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T], attention_mask [B, T] -> (target_hidden [B, T, n*H], target_next [B, T] long):
    the whole forward; target_next[:, t] is the target's greedy token after x[..t]. The LM head runs
    on `chunk_rows` rows at a time, so no [B, T, V] tensor is held."""
    hidden, last = _run_capturing(model, input_ids, attention_mask, layer_ids, stop=False)
    head = model.get_output_embeddings()
    rows = last.reshape(-1, last.shape[-1])  # [B*T, H]
    nxt = torch.cat([head(rows[i : i + chunk_rows]).argmax(-1) for i in range(0, rows.shape[0], chunk_rows)])
    return hidden, nxt.view(last.shape[:2])


@torch.inference_mode()
def target_hidden_and_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T], attention_mask [B, T] -> (target_hidden [B, T, n*H], logits [B, T, V]):
    the whole forward, for distillation; logits[:, t] is the target's next-token prediction after x[t]."""
    tap = FeatureTap(layer_ids)
    with tap.hooked(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return tap.features(), logits  # [B, T, n*H], [B, T, V]
