"""SGLang's own code loads our exports: the draft class, its config parsing, its weight loader and
its Domino rollout, run on CPU in a subprocess (sglang_view.py; SGLang patches transformers globally).

SGLang (the version pyproject's `serve` extra pins) is installed --no-deps by `make sglang-ref`;
two imports are stubbed (sglang_stubs.py says why that is safe). For our tiny exports (Domino, and
head-off plain DFlash, made by our exporter) and the real `artifacts/draft` when present:

- SGLang's model registry maps `architectures` to `sglang.srt.models.dflash.DFlashDraftModel`,
  built from our config.json in bf16;
- every SGLang parameter is NaN-filled, then `load_weights` reads our model.safetensors: each one
  must equal ours exactly (q/k/v and gate/up stacked as SGLang fuses them), none may stay NaN,
  none of our tensors may be left over;
- `parse_dflash_draft_config` and the constructed layers hold exactly our values (block size,
  feature layers, mask id, head sizes, heads, eps, RoPE theta and style, bidirectional attention),
  and SGLang's RoPE gives our rotation;
- `domino_greedy_rollout` and our `DFlashDraftModel.rollout` give the same token chains on random
  blocks, fp32 and bf16 (full-vocabulary correction); zeroing W2 in SGLang gives our head-off chains,
  and those differ from the head-on ones (so the comparison sees the head).
Exports broken on purpose show which refusals are SGLang's and which only our validator makes.

What this does not prove:
- the forward pass and the attention kernels (RadixAttention, flashinfer/triton) SGLang runs on CUDA;
- the worker's capture of the target's hidden states (which layers, the +1 offset) and the KV bookkeeping;
- CUDA graphs (SGLang captures the Domino rollout);
- tensor parallelism above 1 (vocabulary-sharded LM head, candidate pool across ranks);
- the server flags (`--speculative-algorithm DFLASH`, `--speculative-num-draft-tokens`, ...).
Run: make sglang-ref && python -m pytest tests/sglang_code -q
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from sglang_cases import BROKEN, ROLLOUT
from sglang_view import rollout_inputs, rope_inputs

from dominospec.export import check_export_dir
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.models.domino.modeling_domino import apply_rope, rope_cos_sin

LOADABLE = ["domino", "dflash", "artifact"]
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SGLANG_MASK_TOKEN = "<|MASK|>"  # SGLang's default mask string; our mask_token_id takes precedence

# What our validator says about each broken export (conftest.BROKEN holds SGLang's verdict).
BROKEN_PROBLEMS = {
    "missing_backbone_tensor": "tensor layers.1.mlp.down_proj.weight is missing",
    "extra_lm_head": "unexpected tensor lm_head.weight",
    "extra_embed_tokens": "unexpected tensor embed_tokens.weight",
    "f32_tensors": "tensor fc.weight is F32, expected BF16",
    "shift_label_false": "dflash_config.shift_label must be true",
    "attention_bias_true": "attention_bias must be false",
    "use_gemma_norm": "use_gemma_norm must be absent",
    "hidden_act_gelu": "hidden_act must be 'silu'",
    "missing_head_tensor": "tensor embed_proj.2.weight is missing",
    "head_without_projector": "unexpected tensor prefix_gru.weight_ih_l0",
    "emb_dim_mismatch": "top-level emb_dim 16 must equal dflash_config.emb_dim 8",
    "pure_draft_prefix_len_2": "dflash_config.pure_draft_prefix_len must be 1",
    "fc_shape": r"tensor fc.weight has shape \[32, 64\], expected \[32, 96\]",
}


def _case(name, exports, sglang_views):
    """(name, export dir, SGLang's view, our config) of one loadable export."""
    if name not in exports:
        pytest.skip("no real export: params.yaml's paths.draft has no config.json (run `make repro`)")
    view = sglang_views[name]
    assert view["error"] is None, view.get("traceback")
    return name, exports[name], view, DominoDraftConfig.from_pretrained(exports[name])


@pytest.fixture(params=LOADABLE)
def case(request, exports, sglang_views):
    return _case(request.param, exports, sglang_views)


@pytest.fixture(params=[name for name in LOADABLE if name != "dflash"])
def domino_case(request, exports, sglang_views):
    """A loadable export that may carry the Domino head (the plain-DFlash export has none to roll out)."""
    return _case(request.param, exports, sglang_views)


def our_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def test_sglang_builds_its_dflash_draft_class_in_bf16(case):
    _, _, view, _ = case
    assert view["architecture"] == "sglang.srt.models.dflash.DFlashDraftModel"
    assert view["dtype"] == "bfloat16"


def test_every_sglang_parameter_is_loaded_with_our_values(case):
    """NaN-filled before load_weights: a parameter SGLang did not fill, even one row of a fused
    one, stays NaN and cannot equal ours."""
    _, directory, view, _ = case
    ours = our_tensors(directory)
    left = dict(ours)
    for name, param in view["params"].items():
        fused = next((k for k in STACKED if f".{k}." in name), None)
        parts = [name.replace(fused, part) for part in STACKED[fused]] if fused else [name]
        assert all(p in left for p in parts), f"SGLang parameter {name} has no tensor {parts} in our export"
        expected = torch.cat([left.pop(p) for p in parts])
        assert param.dtype == torch.bfloat16 and param.shape == expected.shape, name
        assert not param.isnan().any(), f"SGLang left {name} (partly) unloaded"
        assert torch.equal(param, expected), f"SGLang's {name} differs from ours"
    assert not left, f"our tensors SGLang has no parameter for (silently ignored): {sorted(left)}"


def test_sglang_parses_our_config_values(case):
    _, _, view, config = case
    domino = config.use_domino_head
    assert view["parsed"] == {
        "num_hidden_layers": config.num_hidden_layers,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "target_layer_ids": config.target_layer_ids,
        "mask_token": SGLANG_MASK_TOKEN,
        "mask_token_id": config.mask_token_id,
        "projector_type": "domino" if domino else None,
        "shift_label": True if domino else None,
        "pure_draft_prefix_len": config.pure_draft_prefix_len if domino else None,
        "gru_hidden_dim": config.gru_hidden_dim if domino else None,
        "emb_dim": config.emb_dim if domino else None,
        # SGLang features our draft does not have: all off
        "conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 0,
        "output_multiplier": 1.0, "final_logit_softcapping": None,
        "attention_sink_bias": False, "attention_value_scale": None,
    }


def test_sglang_builds_the_layers_we_trained(case):
    _, _, view, config = case
    eps, D = config.rms_norm_eps, config.head_dim
    layer = {
        "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads, "head_dim": D,
        "scaling": D ** -0.5, "attn_type": "ENCODER_ONLY", "sliding_window_size": -1,  # bidirectional, full
        "v_scale": None, "attention_sink_bias": False, "gemma_norm": False, "q_norm_eps": eps, "k_norm_eps": eps,
        "rope_class": "RotaryEmbedding", "rope_base": config.rope_theta, "rotary_dim": D, "rope_neox": True,
        "rope_max_position": config.max_position_embeddings, "act_fn": "SiluAndMul",
        "input_norm_eps": eps, "post_norm_eps": eps, "convolutions": [False, False],
    }
    assert view["model"] == {
        "block_size": config.block_size, "num_context_features": len(config.target_layer_ids),
        "projector_type": "domino" if config.use_domino_head else None,
        "shift_label": True if config.use_domino_head else None,
        "norm_eps": eps, "hidden_norm_eps": eps, "own_embedding": False, "nemotron_35": False,
        "layers": [layer] * config.num_hidden_layers,
    }


def test_sglang_rope_is_our_rotation(case):
    """SGLang's RoPE (fp32 cos/sin cache, as on CUDA) on random q, k at spread positions = ours (fp32)."""
    _, _, view, config = case
    h, kvh, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    x = rope_inputs(h, kvh, D)
    cos, sin = rope_cos_sin(x["positions"][None], D, config.rope_theta, torch.float32)  # [1, 1, T, D]
    for name, heads in (("q", h), ("k", kvh)):
        ours = apply_rope(x[name].view(1, -1, heads, D).transpose(1, 2), cos, sin).transpose(1, 2).reshape(-1, heads * D)
        torch.testing.assert_close(view["rope"][name], ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_domino_rollout_chains_equal_sglangs(domino_case, dtype):
    name, directory, view, config = domino_case
    if not config.use_domino_head:  # only a real export trained with use_domino_head: false
        pytest.skip("this export is a plain DFlash draft: no Domino rollout (SGLang drafts argmax of the base logits)")
    B, H, V = config.block_size, config.hidden_size, config.vocab_size
    x = rollout_inputs(ROLLOUT["seed"], ROLLOUT["blocks"], B, H, V)
    draft = DFlashDraftModel.from_pretrained(directory, config=config).to(dtype).eval()
    embed = torch.nn.Embedding.from_pretrained(x["embed"].to(dtype))
    z = x["z"].to(dtype)[:, : B - 1]  # shift_label: slot j predicts x[a+1+j]; SGLang drops the last slot
    base = F.linear(z, x["lm_head"].to(dtype))  # [N, B-1, V], the target's LM head as the engine applies it
    ours = draft.rollout(z, base, x["bonus"], embed, num_draft=B - 1).tokens
    draft.config.use_domino_head = False
    ours_head_off = draft.rollout(z, base, x["bonus"], embed, num_draft=B - 1).tokens
    key = str(dtype).removeprefix("torch.")
    assert torch.equal(view["chains"][f"{key}/on"], ours), f"{name}: SGLang's Domino chains differ from ours"
    assert torch.equal(view["chains"][f"{key}/w2_zero"], ours_head_off)
    changed = (ours != ours_head_off).sum().item()
    assert changed > 0, "the head changes no token on these blocks: the comparison would not see it"


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_exports_sglang_verdict_and_ours(name, exports, sglang_views):
    """SGLang 0.5.23 loads some broken exports without a word (verdict None); our validator names
    every one of them."""
    view, verdict = sglang_views[name], BROKEN[name][1]
    if verdict is None:
        assert view["error"] is None, f"SGLang now refuses {name}: {view['error']}"
    else:
        assert view["error"] is not None and re.search(verdict, view["error"]), view["error"]
    problems = check_export_dir(exports[name])
    assert any(re.search(BROKEN_PROBLEMS[name], p) for p in problems), problems


def test_sglang_silence_is_real(sglang_views):
    """The silent cases are not harmless: SGLang keeps the wrong model."""
    missing = sglang_views["missing_backbone_tensor"]["params"]["layers.1.mlp.down_proj.weight"]
    assert missing.isnan().all()  # never loaded: uninitialised memory on a GPU
    assert sglang_views["shift_label_false"]["parsed"]["shift_label"] is False  # the DFlash slot layout: tau ~ 1
    bias = sglang_views["attention_bias_true"]["params"]["layers.0.self_attn.qkv_proj.bias"]
    assert bias.isnan().all()  # a bias with no tensor behind it


def test_the_tiny_exports_pass_our_validator(exports):
    for name in ("domino", "dflash"):
        assert check_export_dir(exports[name]) == [], name
    assert json.loads((exports["domino"] / "config.json").read_text())["rope_theta"] != 10000.0
