"""The export contract: the draft directory stock SGLang (>= 0.5.20) loads with `--speculative-algorithm DFLASH`.

Written once here (docs/design.md §5). The export stage writes to it and checks its own output with
`check_export_dir`; the contract test pins it against the design, literally.

Two profiles, picked by the trained draft's `use_domino_head`:
  domino  dflash_config = {mask_token_id, target_layer_ids, projector_type: "domino",
          pure_draft_prefix_len: 1, emb_dim: r, gru_hidden_dim: G, shift_label: true},
          top-level emb_dim == r, and the four head tensors.
  dflash  head-off drafts, served as plain DFlash: dflash_config = {mask_token_id, target_layer_ids},
          no projector_type, no emb_dim, no head tensors (SGLang refuses head tensors without
          projector_type "domino").
Both: architectures ["DFlashDraftModel"], model_type "qwen3" + the Qwen3 fields, block_size > 1,
num_target_layers, dtype bfloat16, untied, no auto_map, the target's identity; `model.safetensors`
holds exactly `expected_tensors(config)`, all BF16, and nothing else (no embedding, no LM head).

Which checks are SGLang's and which only ours (tests/sglang_code runs SGLang 0.5.23's own loader on
broken exports): SGLang refuses a hidden_act other than silu, a missing head tensor, head tensors
without projector_type "domino", emb_dim copies that differ, pure_draft_prefix_len != 1 and a
wrong fc shape. It loads without a word a draft with a backbone tensor missing (the parameter stays
uninitialised), extra `lm_head`/`embed_tokens` tensors (ignored), F32 tensors (cast), shift_label
false (the DFlash slot layout: acceptance collapses), attention_bias true (biases never loaded) and
the keys of SGLANG_FORBIDDEN_KEYS (another norm, attention or RoPE than the one trained). Only
`check_export_dir` catches those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1  # bump when anything below changes
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
ARCHITECTURES = ["DFlashDraftModel"]
MODEL_TYPE = "qwen3"
DTYPE = "bfloat16"  # config.json `dtype` and `torch_dtype`
TENSOR_DTYPE = "BF16"  # safetensors header dtype of every tensor
DOMINO, DFLASH = "domino", "dflash"

# Integer fields of config.json (Qwen3 shapes + the DFlash block).
INT_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "max_position_embeddings", "vocab_size", "block_size", "num_target_layers",
)
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
DFLASH_KEYS = ("mask_token_id", "target_layer_ids")
# Domino keys of dflash_config with a fixed value, then those that carry the head's shape.
DOMINO_FIXED = {"projector_type": "domino", "pure_draft_prefix_len": 1, "shift_label": True}
DOMINO_SHAPE_KEYS = ("emb_dim", "gru_hidden_dim")
# Fields SGLang's DFlashDraftModel builds from, with the only value our draft has.
FIXED_FIELDS = {"hidden_act": "silu", "attention_bias": False}
# Keys that make SGLang build another draft than ours (Gemma norms, causal attention, partial or
# GPT-J-style RoPE, RoPE scaling, quantised layers, an embedding of its own): never exported.
SGLANG_FORBIDDEN_KEYS = ("use_gemma_norm", "is_causal", "partial_rotary_factor", "rope_is_neox_style", "is_neox_style",
                         "rope_scaling", "quantization_config", "has_embed_tokens")
HEAD_TENSORS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")


def profile(config: dict[str, Any]) -> str:
    """An exported config.json -> DOMINO when dflash_config names a projector, else DFLASH."""
    return DOMINO if "projector_type" in (config.get("dflash_config") or {}) else DFLASH


def expected_tensors(config: dict[str, Any], head: bool) -> dict[str, tuple[int, ...]]:
    """config.json fields -> {tensor name: shape}; the Domino head tensors only when `head`.

    H hidden, D head_dim, I intermediate, n = len(target_layer_ids), G gru_hidden_dim, r emb_dim, V vocab.
    """
    H, D, I = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D
    dflash = config["dflash_config"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        shapes.update({
            layer + "self_attn.q_proj.weight": (q, H),
            layer + "self_attn.k_proj.weight": (kv, H),
            layer + "self_attn.v_proj.weight": (kv, H),
            layer + "self_attn.o_proj.weight": (H, q),
            layer + "self_attn.q_norm.weight": (D,),
            layer + "self_attn.k_norm.weight": (D,),
            layer + "mlp.gate_proj.weight": (I, H),
            layer + "mlp.up_proj.weight": (I, H),
            layer + "mlp.down_proj.weight": (H, I),
            layer + "input_layernorm.weight": (H,),
            layer + "post_attention_layernorm.weight": (H,),
        })
    shapes["fc.weight"] = (H, len(dflash["target_layer_ids"]) * H)
    shapes["hidden_norm.weight"] = (H,)
    shapes["norm.weight"] = (H,)
    if head:
        G, r, V = dflash["gru_hidden_dim"], dflash["emb_dim"], config["vocab_size"]
        shapes["prefix_gru.weight_ih_l0"] = (3 * G, H)  # gates r, z, n
        shapes["prefix_gru.weight_hh_l0"] = (3 * G, G)
        shapes["embed_proj.0.weight"] = (r, H + G)  # W1 over [z ; s]
        shapes["embed_proj.2.weight"] = (V, r)  # W2, full vocabulary
    return shapes


def tensor_problems(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[tuple[int, ...], str]], dtype: str | None
) -> list[str]:
    """Expected {name: shape} vs found {name: (shape, dtype)} -> problems (missing, unexpected,
    wrong shape; wrong dtype when `dtype` is given)."""
    problems = [f"tensor {name} is missing" for name in expected if name not in found]
    problems += [f"unexpected tensor {name}" for name in found if name not in expected]
    for name, shape in expected.items():
        if name not in found:
            continue
        got_shape, got_dtype = found[name]
        if tuple(got_shape) != shape:
            problems.append(f"tensor {name} has shape {list(got_shape)}, expected {list(shape)}")
        if dtype is not None and got_dtype != dtype:
            problems.append(f"tensor {name} is {got_dtype}, expected {dtype}")
    return problems


def check_config(config: dict[str, Any]) -> list[str]:
    """An exported config.json dict -> the ways it breaks the contract (empty when it holds)."""
    problems = []

    def require(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    require(config.get("architectures") == ARCHITECTURES,
            f"architectures must be {ARCHITECTURES}, got {config.get('architectures')}")
    require(config.get("model_type") == MODEL_TYPE,
            f"model_type must be {MODEL_TYPE!r}, got {config.get('model_type')!r}")
    require("auto_map" not in config, "auto_map must be absent (SGLang loads DFlashDraftModel natively)")
    for key in ("dtype", "torch_dtype"):
        require(config.get(key) == DTYPE, f"{key} must be {DTYPE!r}, got {config.get(key)!r}")
    require(config.get("tie_word_embeddings") is False, "tie_word_embeddings must be false")
    for key in INT_FIELDS:
        require(_is_int(config.get(key)) and config[key] > 0,
                f"{key} must be a positive integer, got {config.get(key)!r}")
    for key in FLOAT_FIELDS:
        value = config.get(key)
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"{key} must be a positive number, got {value!r}")
    for key, value in FIXED_FIELDS.items():
        require(key in config and config[key] == value and type(config[key]) is type(value),
                f"{key} must be {json.dumps(value) if isinstance(value, bool) else repr(value)}, "
                f"got {json.dumps(config.get(key)) if isinstance(value, bool) else repr(config.get(key))}")
    for key in SGLANG_FORBIDDEN_KEYS:
        require(key not in config, f"{key} must be absent (SGLang would build another draft), got {config.get(key)!r}")
    target = config.get("target")
    identified = isinstance(target, dict) and bool(target.get("name") and (target.get("revision") or target.get("sha256")))
    require(identified, "target must record the target's identity (name, and revision or sha256)")
    if problems:  # the checks below read these fields
        return problems

    rope = config.get("rope_parameters")  # what transformers 5.x writes next to the plain rope_theta
    require(rope is None or rope == {"rope_type": "default", "rope_theta": config["rope_theta"]},
            f"rope_parameters must be absent or {{rope_type: default, rope_theta: {config['rope_theta']}}}, got {rope}")
    require(config["block_size"] > 1, f"block_size must be > 1, got {config['block_size']}")
    require(config["num_attention_heads"] % config["num_key_value_heads"] == 0,
            "num_attention_heads must be a multiple of num_key_value_heads")
    layer_types = config.get("layer_types")
    require(layer_types == ["full_attention"] * config["num_hidden_layers"],
            f"layer_types must be 'full_attention' x num_hidden_layers, got {layer_types}")
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        return problems + ["dflash_config must be a mapping"]
    mask = dflash.get("mask_token_id")
    require(_is_int(mask) and 0 <= mask < config["vocab_size"],
            f"dflash_config.mask_token_id {mask!r} is not a token id")
    # layer l's output is HF hidden_states[l+1]; the last layer's is normed, so l <= L-2
    ids, last = dflash.get("target_layer_ids"), config["num_target_layers"] - 2
    require(isinstance(ids, list) and len(ids) > 0 and all(_is_int(i) and 0 <= i <= last for i in ids),
            f"dflash_config.target_layer_ids {ids!r} must be layer indices in 0..{last}")

    allowed = set(DFLASH_KEYS)
    if profile(config) == DOMINO:
        allowed |= set(DOMINO_FIXED) | set(DOMINO_SHAPE_KEYS)
        for key, value in DOMINO_FIXED.items():
            require(key in dflash and dflash[key] == value and type(dflash[key]) is type(value),
                    f"dflash_config.{key} must be {json.dumps(value)}, got {json.dumps(dflash.get(key))}")
        for key in DOMINO_SHAPE_KEYS:
            require(_is_int(dflash.get(key)) and dflash[key] > 0, f"dflash_config.{key} must be a positive integer")
        top, nested = config.get("emb_dim"), dflash.get("emb_dim")
        require(top == nested, f"top-level emb_dim {top!r} must equal dflash_config.emb_dim {nested!r}")
    else:
        require("emb_dim" not in config, "a plain DFlash draft has no top-level emb_dim")
    extra = sorted(set(dflash) - allowed)
    require(not extra, f"dflash_config has keys outside the contract: {extra}")
    return problems


def read_tensor_table(weights: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors file -> {name: (shape, dtype name)}, from its header only (no tensor data)."""
    with open(weights, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return {name: (tuple(entry["shape"]), entry["dtype"]) for name, entry in header.items()}


def check_export_dir(path: str | Path) -> list[str]:
    """An export directory -> the ways it breaks the contract (empty when SGLang can load it)."""
    path = Path(path)
    config_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file():
        return [f"{config_file} is missing"]
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        return [f"{config_file} is not valid JSON: {err}"]
    problems = check_config(config)
    if not weights.is_file():
        return problems + [f"{weights} is missing"]
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p != weights)
    if others or (path / f"{WEIGHTS_FILE}.index.json").exists():
        problems.append(f"weights must be the single file {WEIGHTS_FILE}; also found {others or ['an index']}")
    try:
        found = read_tensor_table(weights)
    except (OSError, ValueError, KeyError) as err:
        return problems + [f"{weights} is not a readable safetensors file: {err}"]
    if problems:  # without a sound config the expected shapes cannot be computed
        return problems + [f"{len(found)} tensors not checked against the config"]
    return tensor_problems(expected_tensors(config, head=profile(config) == DOMINO), found, TENSOR_DTYPE)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
