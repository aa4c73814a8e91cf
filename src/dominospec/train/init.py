"""Initialising the draft from the target (params `train.init_from_target`).

Draft layer i starts as a copy of target layer `deepest + 1 + i` (clamped to the last layer),
where `deepest` is the deepest feature layer: the layer that would have consumed that feature
next. `fc` starts by selecting the deepest feature, `hidden_norm` takes that layer's input norm
and the draft's final norm the target's. Only same-shaped layers can be copied: the draft must
keep the target's widths (intermediate size, heads, head_dim), else the run fails by name.
"""

from __future__ import annotations

import torch

from dominospec.cache.tap import decoder_layers
from dominospec.errors import UserError


@torch.no_grad()
def init_from_target(draft: torch.nn.Module, target_model: torch.nn.Module, layer_ids: list[int]) -> None:
    """Copy target decoder layers into the draft's layers in place (see the module docstring)."""
    layers = decoder_layers(target_model)
    H = draft.config.hidden_size
    for i, layer in enumerate(draft.layers):
        source = layers[min(layer_ids[-1] + 1 + i, len(layers) - 1)]
        pairs = [(layer.self_attn, source.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                 (layer.mlp, source.mlp, ("gate_proj", "up_proj", "down_proj")),
                 (layer, source, ("input_layernorm", "post_attention_layernorm"))]
        for ours, theirs, names in pairs:
            for name in names:
                w, src = getattr(ours, name).weight, getattr(theirs, name).weight
                if w.shape != src.shape:
                    raise UserError(f"train.init_from_target: draft {name} is {tuple(w.shape)} but the target's is "
                                    f"{tuple(src.shape)}; keep the draft's widths null (= the target's)")
                w.copy_(src)
    first = layers[min(layer_ids[-1] + 1, len(layers) - 1)]
    draft.fc.weight.zero_()
    draft.fc.weight[:, -H:] = torch.eye(H)  # select the deepest feature
    draft.hidden_norm.weight.copy_(first.input_layernorm.weight)
    draft.norm.weight.copy_(target_model.base_model.norm.weight)


__all__ = ["init_from_target"]
