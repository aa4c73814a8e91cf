"""The lean decoder: a Llama / Qwen3 target's forward on fused kernels (modeling_lean)."""

from .modeling_lean import DecoderOps, LeanDecoder, LeanLayer, LeanStack, pack_layer, unsupported

__all__ = ["DecoderOps", "LeanDecoder", "LeanLayer", "LeanStack", "pack_layer", "unsupported"]
