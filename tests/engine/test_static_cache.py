"""The static-cache runners (what the CUDA graphs replay) compute what the dynamic caches compute.

On CPU the static runners run their graph functions eagerly: the same fixed-size buffers, explicit
masks, device-scalar write positions and crops by moving a length, so everything but the capture
is checked here. In fp64 the two paths differ only by float rounding (masked columns add exact
zeros), so whole generations must match token for token, round for round; the capture itself is
checked token for token on a GPU by benchmarks/gpu_engine.py.
Run: python -m pytest tests/engine/test_static_cache.py -q
"""

import dataclasses

import pytest
import torch
from engine_helpers import engine_params, draft_runners_agree, streaming_cost, random_prompts, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.engine import runners as runners_module
from dominospec.engine.draft_block import StaticDraftBlock
from dominospec.engine.graphs import ShapeGraphs
from dominospec.engine.sampling import Sampling
from dominospec.engine.runners import static_buckets
from dominospec.engine.target_kv import DynamicTargetKV, HFForward, StaticTargetKV

STATIC = engine_params(cuda_graphs="static", graph_capacity=96)


@pytest.mark.parametrize("arch, dtype", [("llama", torch.float64), ("qwen3", torch.float64)])
def test_target_runners_agree_through_prefill_verify_and_crop(arch, dtype):
    target = tiny_target(arch, vocab=32, dtype=dtype)
    layers = [0, target.num_layers - 2]
    dynamic = DynamicTargetKV(target.model, layers)
    static = StaticTargetKV(HFForward(target.model), layers, capacity=64, max_rows=5, graphs=False)
    g = torch.Generator().manual_seed(0)
    steps = [(torch.randint(3, 31, (1, 11), generator=g), 1, None),  # prefill (eager in the static runner)
             (torch.randint(3, 31, (1, 5), generator=g), 5, 13),  # verify 5 rows, keep 2 of them
             (torch.randint(3, 31, (1, 1), generator=g), 1, None),  # AR step
             (torch.randint(3, 31, (1, 4), generator=g), 4, 15),  # after a crop: stale rows 15.. must be masked
             (torch.randint(3, 31, (1, 3), generator=g), 2, None)]
    with torch.inference_mode():
        for ids, keep, crop_to in steps:
            a_logits, a_features = dynamic.forward(ids, keep)
            b_logits, b_features = static.forward(ids, keep)
            assert b_logits.shape == a_logits.shape == (1, keep, 32)
            torch.testing.assert_close(b_logits, a_logits, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(b_features, a_features, rtol=1e-9, atol=1e-9)
            assert static.length == dynamic.length
            if crop_to is not None:
                dynamic.crop(crop_to)
                static.crop(crop_to)


def test_static_target_refuses_to_overflow_or_grow_by_crop():
    target = tiny_target("llama", vocab=32, dtype=torch.float64)
    static = StaticTargetKV(HFForward(target.model), [], capacity=16, max_rows=4, graphs=False)
    with torch.inference_mode():
        static.forward(torch.full((1, 14), 5), keep=1)
        with pytest.raises(ValueError, match="capacity 16"):
            static.forward(torch.full((1, 3), 5), keep=1)
    assert static.length == 14, "a refused forward must leave the cache as it was"
    with pytest.raises(ValueError, match="cannot crop"):
        static.crop(15)


def test_draft_runners_agree_through_extend_block_and_crop(target, draft):
    draft_runners_agree(target, draft, lambda mask_embeds: StaticDraftBlock(
        draft, target.lm_head, target.embed_tokens, mask_embeds, capacity=64, graphs=False))


@pytest.mark.parametrize("mode, num_draft", [("ar", None), ("ngram", None), ("dflash", None), ("domino", None),
                                             ("domino", 3), ("domino", "auto")])
def test_static_engine_generates_what_the_dynamic_engine_does(target, draft, mode, num_draft):
    """Same tokens and the same rounds (so the same drafts were proposed), greedy, fp64."""
    use_draft = draft if mode in ("dflash", "domino") else None
    dynamic = SpecEngine(target, use_draft, mode, num_draft, params=engine_params())
    static = SpecEngine(target, use_draft, mode, num_draft, STATIC)
    if num_draft == "auto":  # the same K choices need the same cost table, and one that is not this machine's timing
        static.cost = dynamic.cost = streaming_cost(dynamic.max_verify)
    accepted = 0
    for prompt in random_prompts(8, 8, seed=4):
        a, b = dynamic.generate(prompt, 40), static.generate(prompt, 40)
        assert b.stats.static_cache and not a.stats.static_cache
        assert b.token_ids == a.token_ids, (mode, prompt)
        assert b.stats.accepted_lengths == a.stats.accepted_lengths
        assert b.stats.target_kv_length == a.stats.target_kv_length == len(prompt) + len(a.token_ids) - 1
        accepted += sum(b.stats.position_accepted)
    if mode != "ar":
        assert accepted > 20, "drafts were hardly ever accepted: the comparison would be weak"


def test_static_engine_sampling_matches_dynamic_with_the_same_seed(target, draft):
    sampling = Sampling(temperature=0.8, top_p=0.95)
    dynamic = SpecEngine(target, draft, "domino", 4, engine_params(ngram_assist=True))
    static = SpecEngine(target, draft, "domino", 4, dataclasses.replace(STATIC, ngram_assist=True))
    for i, prompt in enumerate(random_prompts(6, 8, seed=5)):
        a = dynamic.generate(prompt, 32, sampling, seed=i)
        b = static.generate(prompt, 32, sampling, seed=i)
        assert b.token_ids == a.token_ids and b.stats.accepted_lengths == a.stats.accepted_lengths


def test_a_generation_longer_than_the_static_caches_runs_on_the_dynamic_ones(target, draft):
    small = dataclasses.replace(STATIC, graph_capacity=24)
    dynamic, static = SpecEngine(target, draft, "domino", params=engine_params()), SpecEngine(target, draft, "domino", None, small)
    prompt = random_prompts(1, 8, seed=6, min_len=8, max_len=8)[0]
    long, short = static.generate(prompt, 40), static.generate(prompt, 4)
    assert not long.stats.static_cache and short.stats.static_cache
    assert long.token_ids == dynamic.generate(prompt, 40).token_ids
    assert short.token_ids == dynamic.generate(prompt, 4).token_ids


def test_shape_graphs_fall_back_to_eager_where_capture_fails():
    """On CPU every capture fails (no CUDA): the shape runs eagerly, the failure is recorded once."""
    built = []

    def build(key):
        built.append(key)
        x = torch.full((2,), float(key))
        return lambda: x * 2

    graphs = ShapeGraphs(build, enabled=True)
    for _ in range(2):
        assert graphs.run(3).tolist() == [6.0, 6.0]
    assert built == [3] and list(graphs.failures) == [3]
    eager = ShapeGraphs(build, enabled=False)
    assert eager.run(4).tolist() == [8.0, 8.0] and not eager.failures


def test_params_switch_graphs_on_only_where_cuda_is(tmp_path):
    """engine.cuda_graphs: auto is off on this CPU; on is refused here; a tiny capacity is refused."""
    from pathlib import Path

    from dominospec.config import load_params
    from dominospec.engine.decoding import static_caches
    from dominospec.errors import UserError

    cfg = load_params(Path(__file__).resolve().parents[2] / "params.yaml").engine
    assert cfg.cuda_graphs == "auto" and cfg.graph_capacity >= 2048
    assert static_caches(cfg) == (torch.cuda.is_available(),) * 2
    assert static_caches(dataclasses.replace(cfg, cuda_graphs="off")) == (False, False)
    assert static_caches(dataclasses.replace(cfg, cuda_graphs="static")) == (True, False)  # the caches, eager
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="engine.cuda_graphs: on needs a CUDA GPU"):
            static_caches(dataclasses.replace(cfg, cuda_graphs="on"))
    with pytest.raises(UserError, match="engine.graph_capacity"):
        static_caches(dataclasses.replace(cfg, graph_capacity=8))


def test_static_buckets_double_up_to_the_capacity():
    assert static_buckets(4096) == [256, 512, 1024, 2048, 4096]
    assert static_buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert static_buckets(96) == [96] and static_buckets(256) == [256]


def test_a_generation_runs_on_the_smallest_bucket_that_holds_it(target, draft, monkeypatch):
    """Short and long generations on buckets 32 / 64 / 128 give the dynamic engine's tokens, each
    bucket built once and reused."""
    monkeypatch.setattr(runners_module, "MIN_BUCKET", 32)
    static = SpecEngine(target, draft, "domino", None, dataclasses.replace(STATIC, graph_capacity=128, ngram_assist=True))
    dynamic = SpecEngine(target, draft, "domino", None, engine_params(ngram_assist=True))
    prompt = random_prompts(1, 8, seed=7, min_len=8, max_len=8)[0]
    for new_tokens, bucket in ((8, 32), (40, 64), (100, 128), (8, 32)):
        out = static.generate(prompt, new_tokens)
        assert out.stats.static_cache and out.token_ids == dynamic.generate(prompt, new_tokens).token_ids
        assert static.runners.last == static.runners.buckets[bucket] and static.runners.last[0].capacity == bucket
    assert sorted(static.runners.buckets) == [32, 64, 128]
