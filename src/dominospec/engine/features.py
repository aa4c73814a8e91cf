"""The draft's target features from one target forward, without asking for every layer's hidden states.

`output_hidden_states=True` makes transformers record the output of all L decoder layers (a hook
on each, a tuple of L+1 tensors) when the draft reads n of them (5 of 30 for SmolLM2).
`FeatureTap(model, layer_ids)` instead hooks only the n decoder layers the draft reads, for the
duration of one forward, and concatenates their outputs:

    features = cat(output of layer l for l in layer_ids, dim=-1)   [1, T, n*H]

which is exactly `cat(hidden_states[l + 1] ...)` of the HF convention (layer l's output =
`hidden_states[l + 1]`). With no layer ids it does nothing (AR and prompt lookup).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """HF causal LM -> its list of decoder layers (`model.model.layers` for Llama / Qwen)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


class FeatureTap:
    """Context manager: hooks on the decoder layers `layer_ids` during one forward -> `features()`."""

    def __init__(self, model: Any, layer_ids: Sequence[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> "FeatureTap":
        if self.layer_ids:
            layers = decoder_layers(self.model)
            for l in self.layer_ids:
                self.handles.append(layers[l].register_forward_hook(self._hook(l)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, layer: int):
        def record(module: Any, args: Any, output: Any) -> None:
            self.outputs[layer] = output[0] if isinstance(output, tuple) else output  # [1, T, H]

        return record

    def features(self) -> Optional[torch.Tensor]:
        """-> [1, T, n*H], the recorded layer outputs in `layer_ids` order (None when nothing was tapped)."""
        if not self.layer_ids:
            return None
        return torch.cat([self.outputs[l] for l in self.layer_ids], dim=-1)
