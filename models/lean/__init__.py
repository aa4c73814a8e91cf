"""The lean decoder: a Llama / Qwen3 target's forward on fused kernels (modeling_lean); the Domino draft's
backbone on the same fused ops is `lean_draft.LeanDraft`."""

from .modeling_lean import DecoderOps, LeanDecoder, LeanLayer, LeanStack, pack_layer, unsupported

__all__ = ["DecoderOps", "LeanDecoder", "LeanLayer", "LeanStack", "pack_layer", "unsupported"]
