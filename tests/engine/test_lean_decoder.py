"""The lean decoder (models.lean, engine.target_kv) computes what transformers' forward computes.

On CPU the lean decoder runs its ops' pure-torch references (the Triton kernels are checked against
the same references in tests/kernels/test_decoder_kernels.py, and one tiny forward on the kernels
themselves runs here under the interpreter). In fp64 the lean forward and transformers' differ only
by float rounding, so the runners must agree to 1e-9 through prefill, verify, tree, select and crop,
and whole generations must match the HF static runner's token for token, round for round.
Run: python -m pytest tests/engine/test_lean_decoder.py -q
"""

import copy
import dataclasses

import pytest
import torch
from engine_helpers import engine_params, draft_runners_agree, random_prompts, repetitive_prompts, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.engine.draft_block import LeanDraftBlock
from dominospec.models.lean.lean_draft import LeanDraft
from dominospec.engine.target_kv import LeanForward, StaticTargetKV
from dominospec.engine.runners import lean_decoder
from dominospec.engine.target_kv import DynamicTargetKV
from dominospec.engine.verify_shape import branch_tree
from dominospec.errors import UserError
from dominospec.models.lean import DecoderOps, LeanDecoder, unsupported
from dominospec.target import share_storage

STATIC = engine_params(cuda_graphs="static", graph_capacity=128)
LEAN = dataclasses.replace(STATIC, lean_target="on")


def _steps(vocab: int):
    """(ids [1, T], keep, tree lengths or None, crop to or None, select rows or None): a generation's forwards."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, vocab - 1, (1, n), generator=g)  # noqa: E731
    return [(ids(11), 1, None, None, None),  # prompt: eager causal chain
            (ids(5), 5, None, 13, None),  # verify a chain of 4, keep x_start + 1 accepted
            (ids(1), 1, None, None, None),  # AR step
            (ids(1 + 3 + 2), 6, (3, 2), None, [0, 4, 5]),  # a tree of two branches; the second wins 2 tokens
            (ids(4), 4, None, 15, None),  # rows after a select and a crop
            (ids(3), 2, None, None, None)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lean_runner_agrees_with_transformers_through_prefill_tree_select_and_crop(arch):
    target = tiny_target(arch, vocab=32, dtype=torch.float64)
    layers = [0, target.num_layers - 2]
    dynamic = DynamicTargetKV(target.model, layers)
    lean = StaticTargetKV(LeanForward(LeanDecoder(target.model, DecoderOps.reference())), layers, capacity=64,
                          max_rows=8, graphs=False)
    with torch.inference_mode():
        for ids, keep, lengths, crop_to, rows in _steps(32):
            tree = branch_tree(lengths, "cpu") if lengths else None
            a_logits, a_features = dynamic.forward(ids, keep, tree=tree)
            b_logits, b_features = lean.forward(ids, keep, tree=tree)
            assert b_logits.shape == a_logits.shape == (1, keep, 32)
            torch.testing.assert_close(b_logits, a_logits, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(b_features, a_features, rtol=1e-9, atol=1e-9)
            assert lean.length == dynamic.length
            if rows is not None:
                dynamic.select(rows)
                lean.select(rows)
                dynamic.crop(dynamic.start + len(rows))
                lean.crop(lean.first + len(rows))
            if crop_to is not None:
                dynamic.crop(crop_to)
                lean.crop(crop_to)


def test_lean_draft_block_agrees_with_the_draft_model_through_extend_block_and_crop(target, draft):
    draft_runners_agree(target, draft, lambda mask_embeds: LeanDraftBlock(
        LeanDraft(draft, DecoderOps.reference()), target.lm_head, target.embed_tokens, mask_embeds, capacity=64,
        graphs=False))


def test_rotary_tables_a_runner_read_outlive_a_larger_runner(target, draft):
    """The engines on one target share its lean decoder, the runners of one engine its lean draft, and
    a CUDA graph captured on a runner holds the addresses of the rotary tables it read. Building a runner of a larger cache grows
    the tables: the old ones must stay alive (a freed table is what a replay of the smaller runner's
    graph read next, as an illegal memory access on the GPU after a few prompts), with the same rows."""
    small_target = tiny_target("llama", vocab=32, dtype=torch.float64, max_positions=64)
    decoder = LeanDecoder(small_target.model, DecoderOps.reference())
    lean_draft_ = LeanDraft(draft, DecoderOps.reference())
    mask_embeds = target.embed_tokens(torch.full((3,), 5))
    StaticTargetKV(LeanForward(decoder), [], capacity=32, max_rows=4, graphs=False)
    LeanDraftBlock(lean_draft_, target.lm_head, target.embed_tokens, mask_embeds, capacity=32, graphs=False)
    read = {"target": decoder.cos, "draft": lean_draft_.tables[mask_embeds.dtype][0]}
    StaticTargetKV(LeanForward(decoder), [], capacity=256, max_rows=4, graphs=False)  # past the model's 64 positions
    LeanDraftBlock(lean_draft_, target.lm_head, target.embed_tokens, mask_embeds, capacity=50_000, graphs=False)
    grown = {"target": decoder.cos, "draft": lean_draft_.tables[mask_embeds.dtype][0]}
    kept = {"target": [c for c, _ in decoder.retired], "draft": [c for c, _ in lean_draft_.retired]}
    for name in read:
        assert grown[name].shape[0] > read[name].shape[0]
        assert any(t.data_ptr() == read[name].data_ptr() for t in kept[name]), f"the {name}'s old table was freed"
        assert torch.equal(grown[name][:read[name].shape[0]], read[name])


def test_a_wrong_visibility_bit_changes_the_logits():
    """The tree's bitmask is what the lean verify reads: a row that sees another branch differs."""
    target = tiny_target("llama", vocab=32, dtype=torch.float64)
    lean = StaticTargetKV(LeanForward(LeanDecoder(target.model, DecoderOps.reference())), [], capacity=32, max_rows=8,
                          graphs=False)
    ids = torch.randint(3, 30, (1, 6), generator=torch.Generator().manual_seed(2))
    tree = branch_tree((3, 2), "cpu")
    leak = torch.tensor([[0], [0], [0], [1], [1], [1]]) << 2  # branch 1's rows (3..5) also see row 2, branch 0's second
    wrong = dataclasses.replace(tree, bits=tree.bits | leak)
    with torch.inference_mode():
        lean.forward(ids[:, :3], 1)
        right, _ = lean.forward(ids, 6, tree=tree)
        right = right.clone()
        lean.crop(3)
        bad, _ = lean.forward(ids, 6, tree=wrong)
    assert torch.equal(right[0, :3], bad[0, :3])  # branch 0 and row 0: unchanged
    assert not torch.allclose(right[0, 3:], bad[0, 3:])  # branch 1's rows now see branch 0: changed


def test_building_the_lean_decoder_leaves_the_hf_model_as_it_was():
    """The lean decoder reads the model's weights and changes none of its modules: the same parameters,
    the same storage, the same forward. The Target builds it once per kind of ops, for all its engines."""
    target = tiny_target("qwen3", vocab=32, dtype=torch.float64, seed=4)
    ids = torch.randint(3, 30, (1, 9), generator=torch.Generator().manual_seed(3))
    params = {name: (p, p.data_ptr()) for name, p in target.model.named_parameters()}
    with torch.inference_mode():
        before = target.model(input_ids=ids).logits.clone()
        decoder = lean_decoder(target, triton=False)
        after = target.model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert all(p is params[name][0] and p.data_ptr() == params[name][1] for name, p in target.model.named_parameters())
    assert lean_decoder(target, triton=False) is decoder  # built once per target and kind of ops
    layer, attn = decoder.layers[0], target.model.model.layers[0].self_attn
    q_rows = attn.q_proj.weight.shape[0]
    assert torch.equal(layer.qkv[q_rows:q_rows + attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    assert layer.o.data_ptr() == attn.o_proj.weight.data_ptr()  # unfused weights: the model's own storage
    other = dataclasses.replace(target, model=copy.deepcopy(target.model).float())  # another dtype: its own
    assert lean_decoder(other, triton=False).layers[0].qkv.dtype == torch.float32


def test_fused_weights_are_a_view_when_the_parts_lie_back_to_back():
    """q/k/v (gate/up) stored in one buffer, row after row, fuse without a copy; apart, they are copied."""
    target = tiny_target("llama", vocab=32, dtype=torch.float64)
    mlp = target.model.model.layers[0].mlp
    apart = LeanDecoder(target.model, DecoderOps.reference()).layers[0].gate_up
    assert apart.data_ptr() not in (mlp.gate_proj.weight.data_ptr(), mlp.up_proj.weight.data_ptr())
    with torch.no_grad():  # the caller keeps gate and up in one storage
        both = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        rows = mlp.gate_proj.weight.shape[0]
        mlp.gate_proj.weight = torch.nn.Parameter(both[:rows], requires_grad=False)
        mlp.up_proj.weight = torch.nn.Parameter(both[rows:], requires_grad=False)
    shared = LeanDecoder(target.model, DecoderOps.reference()).layers[0].gate_up
    assert shared.data_ptr() == both.data_ptr() and torch.equal(shared, both)


def test_share_storage_makes_every_fusion_a_view_and_keeps_the_model():
    """The loader's share_storage (on CUDA) lays q/k/v and gate/up back to back: the same values and
    logits, and the lean decoder then fuses them without a copy."""
    target = tiny_target("qwen3", vocab=32, dtype=torch.float64)
    ids = torch.tensor([[1, 5, 7, 3]])
    before = {name: p.clone() for name, p in target.model.named_parameters()}
    logits = target.model(ids).logits
    share_storage(target.model)
    assert all(torch.equal(p, before[name]) for name, p in target.model.named_parameters())
    assert torch.equal(target.model(ids).logits, logits)
    decoder = LeanDecoder(target.model, DecoderOps.reference())
    for layer, lean in zip(target.model.model.layers, decoder.layers):
        assert lean.qkv.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
        assert lean.gate_up.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()


@pytest.mark.parametrize("mode, options", [
    ("ar", {}),
    ("domino", {}),
    ("domino", dict(ngram_assist=True, ngram_fork=True, tree=dict(shape="best_first", nodes=12))),
    ("dflash", dict(ngram_assist=True, ngram_fork=True)),
    ("ngram", {}),
])
def test_engine_on_the_lean_decoder_generates_what_the_static_runner_does(mode, options):
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2, max_positions=128)
    draft = tiny_draft(target, block_size=6, seed=8) if mode in ("domino", "dflash") else None
    options = dict(options)
    tree = options.pop("tree", {})
    plain = SpecEngine(target, draft, mode, None, dataclasses.replace(STATIC, **options).with_tree(**tree))
    lean = SpecEngine(target, draft, mode, None, dataclasses.replace(LEAN, **options).with_tree(**tree))
    assert lean.runners.lean is not None and plain.runners.lean is None
    lean.capture(64)  # every shape run once beforehand (graphs on a GPU): generation is unchanged by it
    for prompt in repetitive_prompts(4, 8, seed=3) + random_prompts(4, 8, seed=2):
        a, b = plain.generate(prompt, 20), lean.generate(prompt, 20)
        assert b.token_ids == a.token_ids, prompt
        assert b.stats.round_tokens == a.stats.round_tokens and b.stats.rounds == a.stats.rounds
        assert b.stats.static_cache


def test_lean_target_auto_off_and_refusals():
    target = tiny_target("llama", vocab=8, dtype=torch.float64, max_positions=128)
    draft = tiny_draft(target, block_size=6, seed=8)
    assert SpecEngine(target, draft, "domino", None, dataclasses.replace(STATIC, lean_target="auto")).runners.lean is None  # CPU
    assert SpecEngine(target, draft, "domino", None, dataclasses.replace(LEAN, cuda_graphs="off")).runners.lean is None
    with pytest.raises(UserError, match="widest round verifies 326 rows, over 320"):
        SpecEngine(target, draft, "domino", None, dataclasses.replace(  # x_start, 256 nodes and a lookup of 69 beside
            LEAN, ngram_assist=True, ngram_fork=True, ngram_num_draft=69).with_tree(shape="best_first", nodes=256))
    with pytest.raises(UserError, match="lean_target must be on, off or auto"):
        SpecEngine(target, None, "ar", None, dataclasses.replace(LEAN, lean_target="yes"))
    target.model.config.hidden_act = "gelu"
    try:
        assert unsupported(target.model) == "hidden_act 'gelu'"
        with pytest.raises(UserError, match="hidden_act 'gelu'"):
            SpecEngine(target, None, "ar", None, LEAN)
    finally:
        target.model.config.hidden_act = "silu"
