"""The Domino head with random weights (benchmarks/head_kernels_gpu.py, gpu_engine.py's projection, the
kernel tests): `HEAD_SHAPES`, `random_head`, `pool_ids`, `head_model` (raw weights in a draft model: the
torch reference every head kernel is compared with) and `head_rollouts` (every rollout path by name).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

HEAD_SHAPES = {  # block 16 -> K = 15 drafts (SmolLM2's default: block 8, K = 7); prefix 1: K - 1 corrected steps
    "qwen3-8b": dict(vocab=151936, hidden=4096, gru=1024, rank=256, num_draft=15, prefix=1, pool=2048),
    "smollm2": dict(vocab=49152, hidden=576, gru=256, rank=64, num_draft=7, prefix=1, pool=2048),
    "smoke": dict(vocab=1000, hidden=64, gru=32, rank=16, num_draft=5, prefix=1, pool=64),
}


def random_head(s: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """Random head weights of shapes `s` and one block's inputs; the correction is as large as the base
    logits, so it changes tokens."""
    g = torch.Generator(device=device).manual_seed(seed)
    V, H, G, r, K = s["vocab"], s["hidden"], s["gru"], s["rank"], s["num_draft"]

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    return dict(embed=randn(V, H, std=0.02), w_ih=randn(3 * G, H, std=1 / H ** 0.5 * 25),
                w_hh=randn(3 * G, G, std=1 / G ** 0.5), w1=randn(r, H + G, std=1 / (H + G) ** 0.5 * 2),
                w2=randn(V, r, std=2 / r ** 0.5), z=randn(K, H), base=randn(K, V),
                x_start=torch.tensor([17], device=device))


def pool_ids(base: torch.Tensor, first: int, size: int) -> torch.Tensor:
    """SGLang's pool as the torch path selects it (engine.draft_head.candidate_pool): top-M of the max over the
    corrected rows' base logits, in no order."""
    return torch.topk(base[first:].max(dim=0).values, size, sorted=False).indices


def head_model(embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               prefix: int, block_size: int) -> tuple[Any, Any]:
    """Raw head weights (E [V, H], W_ih [3G, H], W_hh [3G, G], W1 [r, H+G], W2 [V, r]) -> (a draft model
    carrying them, the embedding module), on their device and dtype: the model's `rollout` on them is the
    torch reference every head kernel is compared with and timed against."""
    from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig

    V, H = embed.shape
    G, r = w_hh.shape[1], w1.shape[0]
    config = DominoDraftConfig(vocab_size=V, hidden_size=H, intermediate_size=4, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                               block_size=max(block_size, prefix, 2), num_target_layers=1, emb_dim=r,
                               dflash_config={"gru_hidden_dim": G, "pure_draft_prefix_len": prefix,
                                              "target_layer_ids": [0], "mask_token_id": 0})
    model = DFlashDraftModel(config).to(embed.device, embed.dtype).eval()
    with torch.no_grad():
        model.prefix_gru.weight_ih_l0.copy_(w_ih)
        model.prefix_gru.weight_hh_l0.copy_(w_hh)
        model.embed_proj[0].weight.copy_(w1)
        model.embed_proj[2].weight.copy_(w2)
    return model, torch.nn.Embedding.from_pretrained(embed)


def head_rollouts(w: dict, s: dict, block_v: Optional[int], table_budget: int, plan: Optional[dict] = None) -> dict:
    """Path name -> a no-argument function returning (tokens [K], scored logits or None); no host sync inside.
    torch / pool torch: the model's rollout (the one torch reference, `head_model`); triton: the
    kernels with the GRU table (`table_budget` bytes), triton, GEMV GRU: without it; pool triton: over the
    fused pool selection (kernels.pool_select). `plan`: kernels.head_rollout.rollout_plan's arguments."""
    import dominospec.kernels.head_rollout as hr
    from dominospec.kernels.pool_select import pool_select, pool_workspace

    P = s["prefix"]
    args = (w["embed"], w["w_ih"], w["w_hh"], w["w1"], w["w2"], P)
    with_table = hr.head_weights(*args, table_budget_bytes=table_budget)
    no_table = hr.head_weights(*args, table_budget_bytes=0)
    pool_ws = pool_workspace(s["vocab"], s["pool"], w["base"].dtype, w["base"].device)  # static buffers

    model, table = head_model(*args, w["z"].shape[0])

    def torch_full():
        out = model.rollout(w["z"], w["base"], w["x_start"], table)
        return out.tokens, out.logits

    def torch_pool():
        out = model.rollout(w["z"], w["base"], w["x_start"], table, pool=pool_ids(w["base"], P, s["pool"]))
        return out.tokens, out.logits

    def triton(weights, pool):
        def run():
            ids = pool_select(w["base"], P, s["pool"], pool_ws) if pool else None  # fused, ids ascending
            return hr.head_rollout(weights, w["z"], w["base"], w["x_start"], ids, block_v=block_v,
                                   **(plan or {})).tokens, None
        return run

    return {"torch": torch_full, "pool torch": torch_pool, "triton": triton(with_table, False),
            "triton, GEMV GRU": triton(no_table, False), "pool triton": triton(with_table, True)}
