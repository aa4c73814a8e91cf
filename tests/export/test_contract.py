"""The export contract (docs/design.md §5), written out here literally so that drift in the code fails CI.

The exported tiny draft: H 32, 4 heads x 12, 2 kv heads, ffn 40, 2 layers, n = 2 feature layers of a
6-layer target, G 20, r 8, V 300, B 4.
Run: python -m pytest tests/export/test_contract.py -q
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from export_helpers import edit_config, edit_tensors

from dominospec.export import check_export_dir

PER_LAYER = {
    "self_attn.q_proj.weight": [48, 32],
    "self_attn.k_proj.weight": [24, 32],
    "self_attn.v_proj.weight": [24, 32],
    "self_attn.o_proj.weight": [32, 48],
    "self_attn.q_norm.weight": [12],
    "self_attn.k_norm.weight": [12],
    "mlp.gate_proj.weight": [40, 32],
    "mlp.up_proj.weight": [40, 32],
    "mlp.down_proj.weight": [32, 40],
    "input_layernorm.weight": [32],
    "post_attention_layernorm.weight": [32],
}
BACKBONE = {
    **{f"layers.{i}.{name}": shape for i in (0, 1) for name, shape in PER_LAYER.items()},
    "fc.weight": [32, 64],  # [H, n*H]
    "hidden_norm.weight": [32],
    "norm.weight": [32],
}
HEAD = {
    "prefix_gru.weight_ih_l0": [60, 32],  # [3G, H]
    "prefix_gru.weight_hh_l0": [60, 20],  # [3G, G]
    "embed_proj.0.weight": [8, 52],  # [r, H+G]
    "embed_proj.2.weight": [300, 8],  # [V, r]
}
DOMINO_DFLASH_CONFIG = {
    "mask_token_id": 299,
    "target_layer_ids": [1, 3],
    "projector_type": "domino",
    "pure_draft_prefix_len": 1,
    "emb_dim": 8,
    "gru_hidden_dim": 20,
    "shift_label": True,
}
QWEN3_FIELDS = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "vocab_size": 300,
    "layer_types": ["full_attention", "full_attention"],
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
    "block_size": 4,
    "num_target_layers": 6,
}


def tensor_table(weights: Path) -> dict[str, tuple[list[int], torch.dtype]]:
    with safe_open(weights, framework="pt") as f:
        return {name: (list(f.get_slice(name).get_shape()), f.get_tensor(name).dtype) for name in f.keys()}


def test_config_json_is_the_sglang_domino_config(exported, tiny_target):
    config = json.loads((Path(exported.paths.draft) / "config.json").read_text())
    for key, value in QWEN3_FIELDS.items():
        assert config[key] == value, key
    assert config["dflash_config"] == DOMINO_DFLASH_CONFIG  # exactly these keys
    assert config["emb_dim"] == 8
    assert "auto_map" not in config
    identity = tiny_target.identity
    assert config["target"]["name"] == identity.name and config["target"]["sha256"] == identity.sha256


def test_weights_are_exactly_the_sglang_tensors_in_bf16(exported):
    table = tensor_table(Path(exported.paths.draft) / "model.safetensors")
    assert {name: shape for name, (shape, _) in table.items()} == {**BACKBONE, **HEAD}
    assert {dtype for _, dtype in table.values()} == {torch.bfloat16}
    assert not any("embed_tokens" in name or "lm_head" in name for name in table)


def test_stock_transformers_reads_the_export_as_a_qwen3_config(exported):
    """What SGLang's config loading sees: AutoConfig on model_type qwen3, no remote code."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(exported.paths.draft)
    assert type(config).__name__ == "Qwen3Config"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 300)
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.dflash_config == DOMINO_DFLASH_CONFIG and config.block_size == 4


def test_the_export_passes_its_own_validator(exported):
    assert check_export_dir(exported.paths.draft) == []


@pytest.mark.parametrize("key", ["use_gemma_norm", "is_causal", "partial_rotary_factor", "rope_is_neox_style",
                                 "is_neox_style", "rope_scaling", "quantization_config", "has_embed_tokens"])
def test_validator_refuses_keys_that_make_sglang_build_another_draft(exported, tmp_path, key):
    """SGLang reads each of these and silently builds another norm, attention, RoPE or layer type."""
    broken = tmp_path / "draft"
    shutil.copytree(exported.paths.draft, broken)
    edit_config(broken, lambda c: c.update({key: True}))
    assert f"{key} must be absent (SGLang would build another draft), got True" in check_export_dir(broken)


@pytest.mark.parametrize(
    "breakage, problem",
    [
        (lambda d: edit_tensors(d, lambda t: t.update({"fc.weight": t["fc.weight"].float()})),
         "tensor fc.weight is F32, expected BF16"),
        (lambda d: edit_tensors(d, lambda t: t.update({"lm_head.weight": torch.zeros(300, 32, dtype=torch.bfloat16)})),
         "unexpected tensor lm_head.weight"),
        (lambda d: edit_tensors(d, lambda t: t.pop("prefix_gru.weight_hh_l0")),
         "tensor prefix_gru.weight_hh_l0 is missing"),
        (lambda d: edit_tensors(d, lambda t: t.update({"embed_proj.2.weight": t["embed_proj.2.weight"].t().contiguous()})),
         r"tensor embed_proj.2.weight has shape \[8, 300\], expected \[300, 8\]"),
        (lambda d: edit_config(d, lambda c: c.update(auto_map={"AutoModel": "domino.DominoDraftModel"})),
         "auto_map must be absent"),
        (lambda d: edit_config(d, lambda c: c.update(emb_dim=16)),
         "top-level emb_dim 16 must equal dflash_config.emb_dim 8"),
        (lambda d: edit_config(d, lambda c: c["dflash_config"].update(shift_label=False)),
         "dflash_config.shift_label must be true"),
        (lambda d: edit_config(d, lambda c: c["dflash_config"].update(pure_draft_prefix_len=2)),
         "dflash_config.pure_draft_prefix_len must be 1"),
        (lambda d: edit_config(d, lambda c: c.update(architectures=["DominoDraftModel"])),
         "architectures must be"),
        (lambda d: edit_config(d, lambda c: c.update(torch_dtype="float32")),
         "torch_dtype must be 'bfloat16'"),
        (lambda d: edit_config(d, lambda c: c["dflash_config"].update(target_layer_ids=[1, 6])),
         "target_layer_ids"),
        (lambda d: edit_config(d, lambda c: c.pop("target")),
         "target must record the target's identity"),
        # SGLang refuses any activation but silu (and swigluoai, which our draft is not)
        (lambda d: edit_config(d, lambda c: c.update(hidden_act="gelu")),
         "hidden_act must be 'silu', got 'gelu'"),
        (lambda d: edit_config(d, lambda c: c.pop("hidden_act")),
         "hidden_act must be 'silu', got None"),
        # SGLang builds q/k/v biases no tensor fills: silent garbage
        (lambda d: edit_config(d, lambda c: c.update(attention_bias=True)),
         "attention_bias must be false, got true"),
        (lambda d: edit_config(d, lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
         "rope_parameters must be absent or"),
        # head tensors without projector_type "domino": SGLang refuses them
        (lambda d: edit_config(d, lambda c: (c.pop("emb_dim"), c.update(dflash_config={"mask_token_id": 299, "target_layer_ids": [1, 3]}))),
         "unexpected tensor prefix_gru.weight_ih_l0"),
    ],
)
def test_validator_names_each_breach(exported, tmp_path, breakage, problem):
    broken = tmp_path / "draft"
    shutil.copytree(exported.paths.draft, broken)
    breakage(broken)
    problems = check_export_dir(broken)
    assert any(re.search(problem, p) for p in problems), problems
