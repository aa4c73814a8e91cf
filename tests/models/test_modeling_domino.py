"""The Domino draft model: export contract, context visibility, cached inference, GRU head, rollout.

Tiny configs on CPU; float64 where two code paths must agree to rounding error.
Run: python -m pytest tests/models -q
"""

import json

import pytest
import torch
from safetensors import safe_open

from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig, DraftContextCache
from dominospec.train.objective import block_attention_mask

# Sizes chosen pairwise distinct, so a transposed or swapped weight shows up in the shape table.
H, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, V, G, R, N_FEAT, BK, MASK = 32, 64, 4, 2, 12, 2, 80, 20, 8, 3, 4, 79


def tiny_config(**overrides) -> DominoDraftConfig:
    kwargs = dict(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rope_theta=10000.0,
        block_size=BK,
        num_target_layers=6,
        emb_dim=R,
        dflash_config=dict(mask_token_id=MASK, target_layer_ids=[0, 2, 4], gru_hidden_dim=G, emb_dim=R),
        target={"name": "tiny", "vocab_size": V},
    )
    kwargs.update(overrides)
    return DominoDraftConfig(**kwargs)


def tiny_model(dtype=torch.float64, seed=0, **overrides) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(tiny_config(**overrides)).to(dtype).eval()


def frozen_target_parts(dtype=torch.float64, seed=1):
    """Stand-ins for the target's embedding table [V, H] and LM head H -> V."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H).to(dtype)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype))
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype) * 0.3)
    return embed.requires_grad_(False), head.requires_grad_(False)


EXPECTED_SHAPES = {
    **{
        f"layers.{i}.{name}": shape
        for i in range(LAYERS)
        for name, shape in {
            "self_attn.q_proj.weight": (48, 32),
            "self_attn.k_proj.weight": (24, 32),
            "self_attn.v_proj.weight": (24, 32),
            "self_attn.o_proj.weight": (32, 48),
            "self_attn.q_norm.weight": (12,),
            "self_attn.k_norm.weight": (12,),
            "mlp.gate_proj.weight": (64, 32),
            "mlp.up_proj.weight": (64, 32),
            "mlp.down_proj.weight": (32, 64),
            "input_layernorm.weight": (32,),
            "post_attention_layernorm.weight": (32,),
        }.items()
    },
    "fc.weight": (32, 96),
    "hidden_norm.weight": (32,),
    "norm.weight": (32,),
    "prefix_gru.weight_ih_l0": (60, 32),
    "prefix_gru.weight_hh_l0": (60, 20),
    "embed_proj.0.weight": (8, 52),
    "embed_proj.2.weight": (80, 8),
}


def test_state_dict_is_exactly_the_export_table():
    model = tiny_model(torch.float32)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == EXPECTED_SHAPES
    assert list(model.buffers()) == []


def test_save_pretrained_writes_the_sglang_contract(tmp_path):
    tiny_model(torch.float32).to(torch.bfloat16).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    for key, value in dict(hidden_size=H, vocab_size=V, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=FFN,
                           block_size=BK, num_target_layers=6, emb_dim=R, rope_theta=10000.0).items():
        assert cfg[key] == value, key
    assert cfg["dflash_config"] == dict(mask_token_id=MASK, target_layer_ids=[0, 2, 4], projector_type="domino",
                                        pure_draft_prefix_len=1, emb_dim=R, gru_hidden_dim=G, shift_label=True)
    for key in ("rms_norm_eps", "max_position_embeddings"):
        assert key in cfg
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(EXPECTED_SHAPES)
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_round_trip_gives_identical_outputs(tmp_path):
    model = tiny_model(torch.float32)
    embed, head = frozen_target_parts(torch.float32)
    feats = torch.randn(1, 9, N_FEAT * H)
    block = embed(torch.tensor([[5] + [MASK] * (BK - 1)]))
    pos = torch.arange(9, 9 + BK)
    model.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    assert loaded.config.to_diff_dict() == model.config.to_diff_dict()

    def outputs(m):
        with torch.no_grad():
            z = m(block, pos, target_features=feats)[0]
            out = m.rollout(z, head(z), torch.tensor(5), embed)
        return z, out.tokens, out.logits

    for a, b in zip(outputs(model), outputs(loaded)):
        assert torch.equal(a, b)


def test_config_reads_other_spellings_and_rejects_inconsistency():
    # transformers 5.x nests rope_theta; older checkpoints say causal_v5 or put emb_dim only inside.
    cfg = tiny_config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, emb_dim=None,
                      dflash_config=dict(mask_token_id=MASK, target_layer_ids=[1], projector_type="causal_v5",
                                         gru_hidden_dim=G, emb_dim=R))
    assert (cfg.rope_theta, cfg.emb_dim, cfg.dflash_config["projector_type"]) == (5e5, R, "domino")
    assert cfg.num_feature_layers == 1 and cfg.pure_draft_prefix_len == 1
    nested = tiny_config(block_size=None, dflash_config=dict(mask_token_id=MASK, target_layer_ids=[1], block_size=8,
                                                             gru_hidden_dim=G, emb_dim=R))
    assert nested.block_size == 8 and "block_size" not in nested.dflash_config
    with pytest.raises(ValueError, match="emb_dim"):
        tiny_config(emb_dim=R + 1)
    with pytest.raises(ValueError, match="shift_label"):
        tiny_config(dflash_config=dict(mask_token_id=MASK, target_layer_ids=[1], gru_hidden_dim=G, emb_dim=R,
                                       shift_label=False))


def _reference_one_layer(model, feats, block, anchor):
    """An independent, loop-level re-derivation of a 1-layer draft for one block: RoPE as complex
    rotation of (x_i, x_{i+D/2}) pairs, kv head of query head h = h // (heads / kv_heads)."""
    sd = {k: v for k, v in model.state_dict().items()}

    def rms(x, w):
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)

    def rope(x, pos):  # x [T, heads, D], pos [T]
        half = HEAD_DIM // 2
        freq = model.config.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD_DIM)
        angle = pos[:, None, None] * freq  # [T, 1, D/2]
        c = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)
        return torch.cat([c.real, c.imag], dim=-1)

    def kv(x, pos):
        k = rms((x @ sd["layers.0.self_attn.k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM),
                sd["layers.0.self_attn.k_norm.weight"])
        return rope(k, pos), (x @ sd["layers.0.self_attn.v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM)

    S = feats.shape[0]
    ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])  # [S, H]
    h = rms(block, sd["layers.0.input_layernorm.weight"])  # [Bk, H]
    q_pos = torch.arange(anchor, anchor + BK, dtype=torch.float64)
    q = rope(rms((h @ sd["layers.0.self_attn.q_proj.weight"].T).view(BK, HEADS, HEAD_DIM),
                 sd["layers.0.self_attn.q_norm.weight"]), q_pos)
    k_ctx, v_ctx = kv(ctx, torch.arange(S, dtype=torch.float64))
    k_blk, v_blk = kv(h, q_pos)
    k, v = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk])  # [S+Bk, kvh, D]
    out = torch.zeros(BK, HEADS, HEAD_DIM, dtype=torch.float64)
    for head in range(HEADS):
        kv_head = head // (HEADS // KV_HEADS)
        p = torch.softmax(q[:, head] @ k[:, kv_head].T / HEAD_DIM**0.5, dim=-1)
        out[:, head] = p @ v[:, kv_head]
    x = block + out.reshape(BK, -1) @ sd["layers.0.self_attn.o_proj.weight"].T
    m = rms(x, sd["layers.0.post_attention_layernorm.weight"])
    gate, up = m @ sd["layers.0.mlp.gate_proj.weight"].T, m @ sd["layers.0.mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(gate) * up) @ sd["layers.0.mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


def test_backbone_matches_an_independent_reference():
    model = tiny_model(num_hidden_layers=1)
    with torch.no_grad():  # non-trivial norm weights, so a missing or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    feats = torch.randn(7, N_FEAT * H, dtype=torch.float64)
    block = torch.randn(BK, H, dtype=torch.float64)
    with torch.no_grad():
        z = model(block[None], torch.arange(7, 7 + BK), target_features=feats[None])[0]
    # RoPE angles are float32 in the model (as in HF), float64 here: differences ~1e-7.
    torch.testing.assert_close(z, _reference_one_layer(model, feats, block, anchor=7), rtol=0, atol=2e-6)


def _training_forward(model, embed, feats, anchors, block_embeds=None):
    """Blocks [x_a, MASK..] at the given anchors of one sequence -> z [N, Bk, H]."""
    S = feats.shape[1]
    anchors = torch.tensor(anchors)
    if block_embeds is None:
        ids = torch.full((len(anchors), BK), MASK)
        ids[:, 0] = torch.arange(len(anchors)) + 3
        block_embeds = embed(ids).reshape(1, -1, H)
    pos = (anchors[:, None] + torch.arange(BK)).reshape(1, -1)
    mask = block_attention_mask(anchors, S, BK)[None, None]
    with torch.no_grad():
        return model(block_embeds, pos, target_features=feats, attention_mask=mask).view(len(anchors), BK, H)


def test_context_is_strictly_before_the_anchor():
    model = tiny_model()
    embed, _ = frozen_target_parts()
    feats = torch.randn(1, 16, N_FEAT * H, dtype=torch.float64)
    z = _training_forward(model, embed, feats, [5, 9])

    later = feats.clone()
    later[:, 5:] += torch.randn_like(later[:, 5:])  # rows >= anchor 5, including the anchor itself
    z_later = _training_forward(model, embed, later, [5, 9])
    assert torch.equal(z_later[0], z[0])
    assert not torch.allclose(z_later[1], z[1])  # the block at anchor 9 sees rows 5..8

    before = feats.clone()
    before[:, 4] += 1.0  # the row just before anchor 5
    z_before = _training_forward(model, embed, before, [5, 9])
    assert (z_before[0] - z[0]).abs().max() > 1e-6


def test_blocks_are_bidirectional_inside_and_isolated_from_each_other():
    model = tiny_model()
    embed, _ = frozen_target_parts()
    feats = torch.randn(1, 16, N_FEAT * H, dtype=torch.float64)
    block_embeds = torch.randn(1, 2 * BK, H, dtype=torch.float64)
    z = _training_forward(model, embed, feats, [5, 9], block_embeds)
    last_slot = block_embeds.clone()
    last_slot[:, BK - 1] += 1.0  # last slot of block 0
    z2 = _training_forward(model, embed, feats, [5, 9], last_slot)
    assert (z2[0, 0] - z[0, 0]).abs().max() > 1e-6  # slot 0 sees slot Bk-1
    assert torch.equal(z2[1], z[1])  # block 1 sees nothing of block 0


def test_cached_inference_equals_training_mode():
    model = tiny_model()
    embed, _ = frozen_target_parts()
    feats = torch.randn(1, 20, N_FEAT * H, dtype=torch.float64)
    anchors = [6, 13]
    z_train = _training_forward(model, embed, feats, anchors)
    ids = torch.full((2, BK), MASK)
    ids[:, 0] = torch.tensor([3, 4])

    cache = DraftContextCache(LAYERS)
    with torch.no_grad():
        # Round 1: the prompt arrives in two pieces (prefill, then one committed row).
        model.extend_context(feats[:, :4], cache)
        z1 = model(embed(ids[:1]), torch.arange(6, 6 + BK), target_features=feats[:, 4:6], cache=cache)
        assert cache.length == 6
        # Round 2: rows 6..12 committed, plus a rejected row that is cropped away again.
        model(embed(ids[1:]), torch.arange(14, 14 + BK), target_features=feats[:, 6:14], cache=cache)
        cache.crop(13)
        z2 = model(embed(ids[1:]), torch.arange(13, 13 + BK), cache=cache)
    assert cache.length == 13
    torch.testing.assert_close(z1[0], z_train[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(z2[0], z_train[1], rtol=0, atol=1e-12)


def test_gru_paths_agree_with_torch_gru():
    model = tiny_model()
    x = torch.randn(3, BK, H, dtype=torch.float64)
    states = model.gru_states(x)  # [3, Bk, G]
    reference, _ = model.prefix_gru(x)  # nn.GRU, bias-free, zero initial state
    torch.testing.assert_close(states, reference, rtol=0, atol=1e-12)
    s = torch.zeros(3, G, dtype=torch.float64)
    for j in range(BK):
        s = model.gru_step(x[:, j], s)
        torch.testing.assert_close(s, reference[:, j], rtol=0, atol=1e-12)


def test_final_logits_keep_the_pure_prefix_and_add_the_correction_after_it():
    model = tiny_model()
    z = torch.randn(2, BK, H, dtype=torch.float64)
    s = torch.randn(2, BK, G, dtype=torch.float64)
    u = torch.randn(2, BK, V, dtype=torch.float64)
    final = model.final_logits(u, z, s)
    assert torch.equal(final[:, 0], u[:, 0])
    torch.testing.assert_close(final[:, 1:], u[:, 1:] + model.correction(z[:, 1:], s[:, 1:]), rtol=0, atol=1e-12)
    assert (final[:, 1:] - u[:, 1:]).abs().max() > 1e-6


def _strong_head(model):
    """Scale W2 up so the correction decides tokens (random init leaves it tiny)."""
    with torch.no_grad():
        model.embed_proj[2].weight.mul_(200.0)
    return model


def test_greedy_rollout_equals_stepwise_recomputation():
    model = _strong_head(tiny_model())
    embed, head = frozen_target_parts()
    z = torch.randn(BK, H, dtype=torch.float64)
    u = head(z)
    last = torch.tensor(7)
    out = model.rollout(z, u, last, embed)
    assert out.tokens.shape == (BK,) and out.logits.shape == (BK, V)

    # Reference: re-run the teacher-forcing GRU over [x_start, d_1..d_j] from scratch at each slot.
    tokens = [int(last)]
    for j in range(BK):
        with torch.no_grad():
            s_j = model.gru_states(embed(torch.tensor([tokens]))).squeeze(0)[-1]
            q = u[j] + model.correction(z[j], s_j) if j >= 1 else u[j]
        torch.testing.assert_close(out.logits[j], q, rtol=0, atol=1e-10)
        tokens.append(int(q.argmax()))
    assert out.tokens.tolist() == tokens[1:]
    assert out.tokens[0] == u[0].argmax()  # the pure-draft prefix ignores the head
    assert out.tokens.tolist() != u.argmax(-1).tolist()  # the head changed something: the test can fail


def test_rollout_with_the_head_off_is_argmax_of_base_logits():
    model = _strong_head(tiny_model(use_domino_head=False))
    embed, head = frozen_target_parts()
    z = torch.randn(2, BK, H, dtype=torch.float64)
    u = head(z)
    out = model.rollout(z, u, torch.tensor([1, 2]), embed)
    assert torch.equal(out.tokens, u.argmax(-1)) and torch.equal(out.logits, u)


def test_sampled_rollout_draws_each_token_from_its_own_corrected_logits():
    model = _strong_head(tiny_model())
    embed, head = frozen_target_parts()
    z = torch.randn(3, BK, H, dtype=torch.float64)
    u = head(z)
    last = torch.tensor([1, 2, 3])
    g = torch.Generator().manual_seed(0)

    def sampler(logits):  # temperature 0.7, the kind of warping the engine applies on both sides
        return torch.multinomial(torch.softmax(logits / 0.7, dim=-1), 1, generator=g).squeeze(-1)

    out = model.rollout(z, u, last, embed, sampler=sampler, num_draft=BK - 1)
    assert out.tokens.shape == (3, BK - 1)
    prefix = torch.cat([last[:, None], out.tokens], dim=1)  # [x_start, d_1..d_K]
    with torch.no_grad():
        states = model.gru_states(embed(prefix[:, :-1]))  # s_j consumed x_start..d_j
        expected = model.final_logits(u[:, : BK - 1], z[:, : BK - 1], states)
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-10)
