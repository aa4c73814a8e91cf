"""Target features: which layers, and one batched forward that returns their outputs.

Layer l is the output of decoder layer l, the raw residual stream, which HF returns as
`hidden_states[l+1]` with `output_hidden_states=True`. `target_hidden` runs the target's base model
(no LM head) and stops after the deepest layer needed; `target_hidden_and_next` (the cache) runs
the whole model and also returns the target's greedy next token at every position.
"""

from __future__ import annotations

from typing import Optional

import torch

from dominospec.errors import UserError
from dominospec.config import CacheParams
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


class _StopForward(Exception):
    """Raised by the hook on the deepest needed layer: nothing after it is computed."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """HF causal LM -> its list of decoder layers (`model.base_model.layers`)."""
    layers: Optional[torch.nn.ModuleList] = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"target {type(model).__name__}: no decoder layer list at base_model.layers")
    return layers


def _run_capturing(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   layer_ids: list[int], stop: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The base model's forward with the outputs of `layer_ids` captured -> (target_hidden
    [B, T, n*H], last hidden state [B, T, H] after the final norm, or None when `stop` cut the
    forward after the deepest captured layer)."""
    layers = decoder_layers(model)
    outputs: dict[int, torch.Tensor] = {}
    deepest = layer_ids[-1]

    def capture(layer_id: int):
        def hook(_module: torch.nn.Module, _args: object, output: object) -> None:
            hidden = output[0] if isinstance(output, tuple) else output  # [B, T, H]
            outputs[layer_id] = hidden
            if stop and layer_id == deepest:
                raise _StopForward

        return hook

    handles = [layers[l].register_forward_hook(capture(l)) for l in layer_ids]
    last = None
    try:
        last = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([outputs[l] for l in layer_ids], dim=-1), last  # [B, T, n*H], [B, T, H] | None


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
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True)
    hidden = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1)  # [B, T, n*H]
    return hidden, out.logits
