"""Shared by the kernel tests: device, tolerances relative to the output's scale, and the skip when triton is absent."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """|actual - expected| <= rel * max|expected| elementwise (rtol 0): a tolerance that scales with the
    output and stays far below it, so a wrong kernel cannot pass."""
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), atol=rel * max(scale, 1e-30), rtol=0.0)


def model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, pool_ids=None, first=None):
    """The one torch reference of the head's rollout, the model's `rollout`, run on these raw weights:
    E [V, H], W_ih [3G, H], W_hh [3G, G], W1 [r, H+G], W2 [V, r] in their dtype, z [K, H], u [K, V],
    x_start [1] -> (tokens [K] (or [W, K] with `first` [W]), the scored logits [K, V] (or [W, K, V])
    with -inf outside `pool_ids`)."""
    from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig

    V, H = embed.shape
    G, r, K = w_hh.shape[1], w1.shape[0], z.shape[0]
    config = DominoDraftConfig(vocab_size=V, hidden_size=H, intermediate_size=4, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=4, block_size=max(K, P, 2),
                               num_target_layers=1, emb_dim=r,
                               dflash_config={"gru_hidden_dim": G, "pure_draft_prefix_len": P,
                                              "target_layer_ids": [0], "mask_token_id": 0})
    model = DFlashDraftModel(config).to(embed.device, embed.dtype).eval()
    with torch.no_grad():
        model.prefix_gru.weight_ih_l0.copy_(w_ih)
        model.prefix_gru.weight_hh_l0.copy_(w_hh)
        model.embed_proj[0].weight.copy_(w1)
        model.embed_proj[2].weight.copy_(w2)
    table = torch.nn.Embedding.from_pretrained(embed)
    out = model.rollout(z, base, x_start, table, pool=pool_ids, first=first)
    return out.tokens, out.logits
