"""SGLang's view of our export directories, computed by SGLang's own code: run in a subprocess.

    PYTHONPATH=SITE python tests/sglang_code/sglang_view.py REQUEST.json

SITE is the dir holding the `sglang` package (installed --no-deps, see the Makefile); the caller
puts it first on PYTHONPATH. REQUEST.json: {"site": SITE,
"out": dir, "cases": {name: {"dir": export dir, "rollout": null | {"seed", "blocks"}}}}.
For each case it writes `out/<name>.pt`, a dict:

  error         null, or "<stage>: <Exception>: <message>" where SGLang refused the directory
                (stage config | init | load); the keys below stop at the failing stage
  architecture  module.class SGLang's model registry picked for config.json's `architectures`
  dtype         the weight dtype SGLang's ModelConfig resolved
  parsed        dataclasses.asdict(parse_dflash_draft_config(hf_config))
  model         what the constructed `DFlashDraftModel` and its layers were built with (`model_view`)
  rope          SGLang's RoPE `forward_native` on `rope_inputs(...)`, fp32 cos/sin cache (as on CUDA)
  params        {name: tensor} of every parameter, NaN-filled before `load_weights` ran on
                `model.safetensors` (read by SGLang's own safetensors iterator)
  chains        Domino drafts only: {"<dtype>/<head>": [N, B-1] tokens} from `domino_greedy_rollout`
                on `rollout_inputs(...)`, dtype float32 | bfloat16, head on | w2_zero
                (W2 = embed_proj.2 zeroed: the correction vanishes, the chain is argmax of the
                base logits), full-vocabulary correction (candidate_pool_size 0)

This file runs SGLang, which patches transformers globally: never import SGLang into the test
process. The test process imports only `rollout_inputs` and `rope_inputs` from here, which need torch alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

import torch


def rollout_inputs(seed: int, blocks: int, block_size: int, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    """Random draft blocks and target tables, the same in every process for the same arguments (fp32):
    z [N, B, H] ~ N(0, 1) (the scale of a normed hidden), bonus tokens [N], embedding and LM head
    [V, H] ~ N(0, 0.05^2)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "z": torch.randn(blocks, block_size, hidden, generator=g),
        "bonus": torch.randint(0, vocab, (blocks,), generator=g),
        "embed": torch.randn(vocab, hidden, generator=g) * 0.05,
        "lm_head": torch.randn(vocab, hidden, generator=g) * 0.05,
    }


def rope_inputs(heads: int, kv_heads: int, head_dim: int, tokens: int = 48) -> dict[str, torch.Tensor]:
    """Positions [T] spread over 0..1000 and random q [T, h*D], k [T, kvh*D] (fp32)."""
    g = torch.Generator().manual_seed(7)
    return {
        "positions": torch.randint(0, 1000, (tokens,), generator=g),
        "q": torch.randn(tokens, heads * head_dim, generator=g),
        "k": torch.randn(tokens, kv_heads * head_dim, generator=g),
    }


def model_view(model) -> dict:
    """A constructed SGLang DFlashDraftModel -> the values it was built with (plain Python)."""
    layers = []
    for layer in model.layers:
        attn, rope = layer.self_attn, layer.self_attn.rotary_emb
        layers.append({
            "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim,
            "scaling": attn.scaling, "attn_type": attn.attn_type.name, "sliding_window_size": attn.sliding_window_size,
            "v_scale": attn.v_scale, "attention_sink_bias": attn.attention_sink_bias is not None,
            "gemma_norm": attn.use_gemma_norm, "q_norm_eps": attn.q_norm.variance_epsilon,
            "k_norm_eps": attn.k_norm.variance_epsilon, "rope_class": type(rope).__name__,
            "rope_base": float(rope.base), "rotary_dim": rope.rotary_dim, "rope_neox": rope.is_neox_style,
            "rope_max_position": rope.max_position_embeddings, "act_fn": type(layer.mlp.act_fn).__name__,
            "input_norm_eps": layer.input_layernorm.variance_epsilon,
            "post_norm_eps": layer.post_attention_layernorm.variance_epsilon,
            "convolutions": [layer.attention_conv is not None, layer.mlp_conv is not None],
        })
    return {
        "block_size": model.block_size, "num_context_features": model.num_context_features,
        "projector_type": model.projector_type, "shift_label": model.shift_label,
        "norm_eps": model.norm.variance_epsilon, "hidden_norm_eps": model.hidden_norm.variance_epsilon,
        "own_embedding": model.embed_tokens is not None, "nemotron_35": model.is_nemotron_35_draft,
        "layers": layers,
    }


def domino_chains(model, vocab: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SGLang's domino_greedy_rollout with the loaded head, per dtype, head on and W2 zeroed."""
    import copy

    from sglang.srt.speculative.domino_utils import domino_greedy_rollout

    chains = {}
    for dtype in (torch.float32, torch.bfloat16):
        for head in ("on", "w2_zero"):
            gru, proj = copy.deepcopy(model.prefix_gru).to(dtype), copy.deepcopy(model.embed_proj).to(dtype)
            if head == "w2_zero":
                with torch.no_grad():
                    proj[2].weight.zero_()
            embedding = torch.nn.Embedding.from_pretrained(inputs["embed"].to(dtype))
            tokens = domino_greedy_rollout(
                draft_hidden=inputs["z"].to(dtype), bonus_tokens=inputs["bonus"], target_embedding=embedding,
                lm_head_weight=inputs["lm_head"].to(dtype), prefix_gru=gru, embed_proj=proj, vocab_size=vocab,
                shift_label=model.shift_label, candidate_pool_size=0, in_cuda_graph=False,
            )
            chains[f"{str(dtype).removeprefix('torch.')}/{head}"] = tokens.clone()
    return chains


def view(directory: str, rollout: dict | None) -> dict:
    """One export directory -> SGLang's view of it (see the module docstring)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture, set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    out: dict = {"error": None}
    stage = "config"
    try:
        # As the DFLASH server builds its draft: ModelConfig(draft path, is_draft_model=True), the
        # registry's class for `architectures`, constructed under the resolved default dtype.
        config = ModelConfig(directory, trust_remote_code=False, is_draft_model=True, speculative_algorithm="DFLASH")
        model_class, _ = get_model_architecture(config)
        out["architecture"] = f"{model_class.__module__}.{model_class.__qualname__}"
        out["dtype"] = str(config.dtype).removeprefix("torch.")
        out["parsed"] = dataclasses.asdict(parse_dflash_draft_config(draft_hf_config=config.hf_config))
        stage = "init"
        with set_default_torch_dtype(config.dtype):
            model = model_class(config=config.hf_config, quant_config=None)
        out["model"] = model_view(model)
        attn = model.layers[0].self_attn
        rope = rope_inputs(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        rope_q, rope_k = attn.rotary_emb.forward_native(rope["positions"], rope["q"].clone(), rope["k"].clone())
        out["rope"] = {"q": rope_q.clone(), "k": rope_k.clone()}
        stage = "load"
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        model.load_weights(safetensors_weights_iterator([str(Path(directory) / "model.safetensors")]))
        out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        if rollout is not None and model.projector_type == "domino":
            hf = config.hf_config
            inputs = rollout_inputs(rollout["seed"], rollout["blocks"], model.block_size, hf.hidden_size, hf.vocab_size)
            out["chains"] = domino_chains(model, hf.vocab_size, inputs)
    except Exception as err:  # a refusal is a result: the test compares it with our validator's
        out["error"] = f"{stage}: {type(err).__name__}: {err}"
        out["traceback"] = traceback.format_exc()
    return out


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    import sglang_stubs

    sglang_stubs.install()
    # CUDA keeps RoPE's cos/sin cache in fp32; CPU would round it to the weight dtype (bf16).
    os.environ["SGLANG_ROPE_CACHE_FP32"] = "1"
    torch.set_num_threads(1)
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=int(request.get("port", 29632)), backend="gloo")
    out = Path(request["out"])
    for name, case in request["cases"].items():
        torch.save(view(case["dir"], case.get("rollout")), out / f"{name}.pt")
    import sglang

    (out / "version.txt").write_text(sglang.__version__)


if __name__ == "__main__":
    main()
