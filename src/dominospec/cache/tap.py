"""Which tensor is "the output of target layer l", written once for the cache, the engine and the lean decoder.

Layer l is the output of decoder layer l (0-based), the raw residual stream before the next
layer's norm: HF's `hidden_states[l + 1]` with `output_hidden_states=True`. The features of a
forward are those outputs for the wanted layer ids, concatenated:

    features = cat(output of layer l for l in layer_ids, dim=-1)     [..., T, n*H]

`FeatureTap(layer_ids)` collects them from one forward: `hooked(model)` hooks the n decoder
layers of an HF model (not all L of them, as `output_hidden_states` would), and a forward of our
own (models.lean) calls `record(l, output)` for every layer. With no layer ids it collects nothing
and `features()` is None (AR and prompt lookup).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch

from dominospec.errors import UserError


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """HF causal LM (or its base model) -> its list of decoder layers (`model.base_model.layers`)."""
    layers: Optional[torch.nn.ModuleList] = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"target {type(model).__name__}: no decoder layer list at base_model.layers")
    return layers


class StopForward(Exception):
    """Raised by the hook on the deepest wanted layer when a forward need go no further."""


class FeatureTap:
    """The outputs of decoder layers `layer_ids` in one forward -> `features()` [..., T, n*H]."""

    def __init__(self, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}

    def record(self, layer: int, output: torch.Tensor) -> None:
        """Layer `layer`'s output [..., T, H] (kept when it is a wanted layer)."""
        if layer in self.layer_ids:
            self.outputs[layer] = output

    def features(self) -> Optional[torch.Tensor]:
        """-> [..., T, n*H], the recorded outputs in `layer_ids` order (None when no layer is wanted)."""
        if not self.layer_ids:
            return None
        return torch.cat([self.outputs[l] for l in self.layer_ids], dim=-1)

    @contextmanager
    def hooked(self, model: torch.nn.Module, stop: bool = False) -> Iterator["FeatureTap"]:
        """Hooks on the wanted layers of an HF model for the forwards run inside the block. `stop`:
        the deepest wanted layer ends the forward (`StopForward`, swallowed here): nothing after it runs."""
        layers = decoder_layers(model) if self.layer_ids else []
        deepest = max(self.layer_ids, default=-1)

        def hook(layer: int):
            def record(_module: Any, _args: Any, output: Any) -> None:
                self.record(layer, output[0] if isinstance(output, tuple) else output)
                if stop and layer == deepest:
                    raise StopForward

            return record

        handles = [layers[l].register_forward_hook(hook(l)) for l in self.layer_ids]
        try:
            yield self
        except StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
