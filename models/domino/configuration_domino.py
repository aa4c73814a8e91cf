"""Configuration of the Domino draft: a Qwen3-style DFlash backbone plus the GRU correction head.

The saved `config.json` is what stock SGLang reads for `--speculative-algorithm DFLASH`:
`architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`, the plain Qwen3 fields (with a
top-level `rope_theta`), `block_size`, `num_target_layers`, `emb_dim`, and the nested
`dflash_config` = {mask_token_id, target_layer_ids, projector_type, pure_draft_prefix_len,
emb_dim, gru_hidden_dim, shift_label}.

The class derives from `PretrainedConfig` with an explicit `__init__` (not from `Qwen3Config`),
so that it behaves the same on transformers 4.5x and 5.x: 5.x moved `rope_theta` into
`rope_parameters` and turned configs into strict dataclasses, neither of which applies here.
The keyword defaults describe the paper's Qwen3-8B draft; the pipeline passes every field.
"""

from __future__ import annotations

from typing import Any, Optional

from transformers import PretrainedConfig

PROJECTOR_TYPE = "domino"
# Older Domino checkpoints name the same head "causal_v5".
PROJECTOR_ALIASES = {"domino": "domino", "causal_v5": "domino"}


class DominoDraftConfig(PretrainedConfig):
    """Hyper-parameters of `DFlashDraftModel`; `dflash_config` carries the Domino specifics."""

    model_type = "qwen3"

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 5,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int = 128,
        hidden_act: str = "silu",
        max_position_embeddings: int = 40960,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        rope_theta: Optional[float] = 1_000_000.0,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        use_sliding_window: bool = False,
        sliding_window: Optional[int] = None,
        max_window_layers: Optional[int] = None,
        layer_types: Optional[list[str]] = None,
        block_size: Optional[int] = None,
        num_target_layers: int = 36,
        emb_dim: Optional[int] = None,
        dflash_config: Optional[dict[str, Any]] = None,
        use_domino_head: bool = True,
        target: Optional[dict[str, Any]] = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ):
        # transformers 5.x writes {"rope_parameters": {"rope_theta": ..., "rope_type": "default"}}.
        rope_parameters = kwargs.pop("rope_parameters", None)
        kwargs.pop("rope_scaling", None)
        if rope_parameters:
            if rope_parameters.get("rope_type", "default") != "default":
                raise ValueError(f"only default RoPE is supported, got {rope_parameters}")
            rope_theta = rope_parameters.get("rope_theta", rope_theta)

        dflash = dict(dflash_config or {})
        # Some checkpoints keep block_size inside dflash_config; SGLang reads the top-level one.
        nested_block_size = dflash.pop("block_size", None)
        if block_size is None:
            block_size = nested_block_size if nested_block_size is not None else 16
        elif nested_block_size is not None and nested_block_size != block_size:
            raise ValueError(f"block_size {block_size} differs from dflash_config.block_size {nested_block_size}")
        dflash.setdefault("mask_token_id", None)
        dflash.setdefault("target_layer_ids", [1, 9, 17, 25, 33])
        dflash.setdefault("projector_type", PROJECTOR_TYPE)
        dflash.setdefault("pure_draft_prefix_len", 1)
        dflash.setdefault("emb_dim", emb_dim if emb_dim is not None else 256)
        dflash.setdefault("gru_hidden_dim", 1024)
        dflash.setdefault("shift_label", True)
        if dflash["projector_type"] not in PROJECTOR_ALIASES:
            raise ValueError(f"dflash_config.projector_type must be 'domino', got {dflash['projector_type']!r}")
        dflash["projector_type"] = PROJECTOR_ALIASES[dflash["projector_type"]]
        if emb_dim is None:
            emb_dim = dflash["emb_dim"]
        if emb_dim != dflash["emb_dim"]:
            raise ValueError(f"emb_dim {emb_dim} differs from dflash_config.emb_dim {dflash['emb_dim']}")
        if not dflash["shift_label"]:
            raise ValueError("only shift_label=true (slot j predicts x[a+1+j]) is implemented")
        if not 0 <= dflash["pure_draft_prefix_len"] <= block_size:
            raise ValueError(f"pure_draft_prefix_len must lie in [0, block_size], got {dflash['pure_draft_prefix_len']}")
        if num_attention_heads % num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = float(rope_theta)
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window
        self.max_window_layers = num_hidden_layers if max_window_layers is None else max_window_layers
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.emb_dim = emb_dim
        self.dflash_config = dflash
        self.use_domino_head = use_domino_head
        self.target = target
        if hidden_act != "silu" or attention_bias or use_sliding_window:
            raise ValueError("the draft is SwiGLU, bias-free and full attention only")
        if any(t != "full_attention" for t in self.layer_types):
            raise ValueError(f"layer_types must all be 'full_attention', got {self.layer_types}")
        kwargs.setdefault("architectures", ["DFlashDraftModel"])
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    # Read-only views of dflash_config, so model code names the domain, not dict keys.
    @property
    def mask_token_id(self) -> Optional[int]:
        return self.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.dflash_config["target_layer_ids"])

    @property
    def num_feature_layers(self) -> int:
        return len(self.dflash_config["target_layer_ids"])

    @property
    def gru_hidden_dim(self) -> int:
        return self.dflash_config["gru_hidden_dim"]

    @property
    def pure_draft_prefix_len(self) -> int:
        return self.dflash_config["pure_draft_prefix_len"]
