"""KV bookkeeping, stops and limits of the engine, on tiny fp64 targets.

- After a generation the target KV holds prompt + new - 1 rows, and its contents equal those of
  one fresh forward over that sequence; the draft context holds the same rows, and its K/V equal
  the draft's projection of the target features of that sequence (so exactly the accepted
  tokens' features were appended, at the right positions).
- Stop tokens, stop strings, max_new_tokens (even mid-block) and the context length end a
  generation exactly where AR decoding ends it.
Run: python -m pytest tests/engine/test_bookkeeping.py -q
"""

import pytest
import torch
from engine_helpers import engine_params, EOS, random_prompts, tiny_draft, tiny_target

import dominospec.engine.draft_block as draft_block_module
import dominospec.engine.accept as accept_module
import dominospec.engine.target_kv as target_kv_module
from dominospec.errors import UserError
from dominospec.engine import Sampling, SpecEngine
from dominospec.runtime.kv import cache_argument, crop_kv, kv_length
from dominospec.models.domino import DraftContextCache


def record_caches(monkeypatch) -> dict:
    """Make the engine's dynamic caches inspectable after `generate` returns."""
    seen = {}

    class RecordedKV(target_kv_module.DynamicCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["kv"] = self

    class RecordedContext(DraftContextCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["context"] = self

    monkeypatch.setattr(target_kv_module, "DynamicCache", RecordedKV)
    monkeypatch.setattr(draft_block_module, "DraftContextCache", RecordedContext)
    return seen


def static_caches(engine: SpecEngine, rows: int) -> tuple:
    """The static runners' first `rows` rows, in the shapes of the dynamic caches (SimpleNamespaces)."""
    from types import SimpleNamespace

    kv, drafter = engine.runners.last
    layers = [SimpleNamespace(keys=l.keys[:, :, :rows], values=l.values[:, :, :rows]) for l in kv.fwd.cache.layers]
    context = SimpleNamespace(keys=[k[:, :, :rows] for k in drafter.keys], values=[v[:, :, :rows] for v in drafter.values])
    return SimpleNamespace(layers=layers), context, kv.length, drafter.length


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("mode", ["dflash", "domino"])
def test_caches_hold_exactly_the_committed_prefix(target, draft, monkeypatch, mode, static):
    seen = record_caches(monkeypatch)
    engine = SpecEngine(target, draft, mode, None, engine_params(cuda_graphs="static" if static else "off", graph_capacity=64))
    checked = 0
    for prompt in random_prompts(6, 8, seed=11):
        out = engine.generate(prompt, 20)
        sequence = torch.tensor([prompt + out.token_ids[:-1]])  # everything that has been fed
        rows = sequence.shape[1]
        assert out.stats.target_kv_length == out.stats.draft_context_length == rows
        if static:
            seen["kv"], seen["context"], kv_rows, context_rows = static_caches(engine, rows)
            assert kv_rows == context_rows == rows
        else:
            assert kv_length(seen["kv"]) == seen["context"].length == rows

        from transformers import DynamicCache

        with torch.inference_mode():
            fresh = DynamicCache()
            full = target.model(input_ids=sequence, **{cache_argument(target.model): fresh}, output_hidden_states=True)
            features = torch.cat([full.hidden_states[l + 1] for l in draft.config.target_layer_ids], -1)
            context = DraftContextCache(len(draft.layers))
            draft.extend_context(features, context)
        for layer in range(len(fresh.layers)):
            torch.testing.assert_close(seen["kv"].layers[layer].keys, fresh.layers[layer].keys, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(seen["kv"].layers[layer].values, fresh.layers[layer].values, rtol=1e-9, atol=1e-9)
        for layer in range(len(draft.layers)):
            torch.testing.assert_close(seen["context"].keys[layer], context.keys[layer], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(seen["context"].values[layer], context.values[layer], rtol=1e-9, atol=1e-9)
        checked += out.stats.rounds > 1 and sum(out.stats.position_accepted) > 0
    assert checked >= 2, "no generation had several rounds with accepted drafts"


def test_ar_cache_holds_prompt_plus_new_minus_one(target):
    out = SpecEngine(target, None, "ar", params=engine_params()).generate([3, 4, 5], 9)
    assert out.stats.target_kv_length == 3 + len(out.token_ids) - 1
    assert out.stats.rounds == len(out.token_ids) - 1 and out.stats.acceptance_length == 1.0


def test_max_new_tokens_is_never_exceeded_even_mid_block(target, draft):
    ar, spec = SpecEngine(target, None, "ar", params=engine_params()), SpecEngine(target, draft, "domino", params=engine_params())
    spec.stop_ids = ar.stop_ids = frozenset()  # only the budget ends these generations
    # A prompt with rounds committing 3+ tokens, so some budgets end inside a block.
    prompt = next(p for p in random_prompts(30, 8, seed=3) if max(spec.generate(p, 30).stats.accepted_lengths) >= 3)
    reference = ar.generate(prompt, 30).token_ids
    for budget in range(1, 31):
        out = spec.generate(prompt, budget)
        assert out.token_ids == reference[:budget] and out.finish_reason == "length"
        assert out.stats.target_kv_length == out.stats.draft_context_length == len(prompt) + budget - 1


def test_stop_token_ends_like_ar(target, draft):
    ar, spec = SpecEngine(target, None, "ar", params=engine_params()), SpecEngine(target, draft, "domino", params=engine_params())
    stopped = 0
    for prompt in random_prompts(20, 8, seed=5):
        expected, out = ar.generate(prompt, 40), spec.generate(prompt, 40)
        assert out.token_ids == expected.token_ids and out.finish_reason == expected.finish_reason
        if out.finish_reason == "stop_token":
            stopped += 1
            assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
            assert "t2" not in out.text  # special tokens are not decoded
    assert stopped >= 3


def test_stop_string_cuts_the_text_before_it(target, draft):
    ar, spec = SpecEngine(target, None, "ar", params=engine_params()), SpecEngine(target, draft, "domino", params=engine_params())
    spec.stop_ids = ar.stop_ids = frozenset()
    prompt = [4, 4, 7]
    free = ar.generate(prompt, 30).text
    stop = free.split()[5]  # a word that occurs in the answer
    out = spec.generate(prompt, 30, stop_strings=[stop])
    assert out.finish_reason == "stop_string"
    assert out.text == free[: free.index(stop)]
    assert stop in spec._decode(out.token_ids) and stop not in spec._decode(out.token_ids[:-1])
    assert out.stats.target_kv_length == out.stats.draft_context_length == len(prompt) + len(out.token_ids) - 1


def test_context_length_limits_generation_and_rejects_long_prompts(draft):
    small = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2, max_positions=24)
    spec = SpecEngine(small, tiny_draft(small, block_size=8, seed=8), "domino", params=engine_params())
    ar = SpecEngine(small, None, "ar", params=engine_params())
    spec.stop_ids = ar.stop_ids = frozenset()
    prompt = random_prompts(1, 8, seed=2, min_len=20, max_len=20)[0]
    out = spec.generate(prompt, 50)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert out.token_ids == ar.generate(prompt, 50).token_ids
    with pytest.raises(UserError, match="the prompt has 24 tokens but the target's context holds 24"):
        spec.generate(prompt + [3, 3, 3, 3], 5)
    with pytest.raises(UserError, match="empty"):
        spec.generate([], 5)
    with pytest.raises(UserError, match="max_new_tokens"):
        spec.generate(prompt, 0)


def test_sampling_is_reproducible_by_seed(target, draft):
    spec = SpecEngine(target, draft, "domino", params=engine_params())
    spec.stop_ids = frozenset()
    sampling = Sampling(temperature=1.0)
    a, b = spec.generate([3, 4], 16, sampling, seed=7), spec.generate([3, 4], 16, sampling, seed=7)
    c = spec.generate([3, 4], 16, sampling, seed=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_round_statistics_are_consistent(target, draft):
    out = SpecEngine(target, draft, "domino", params=engine_params()).generate([3, 5, 7], 25)
    s = out.stats
    assert s.new_tokens == len(out.token_ids) == s.round_tokens + 1
    assert s.rounds == len(s.accepted_lengths) and s.acceptance_length == s.round_tokens / s.rounds
    assert all(a >= b for a, b in zip(s.position_proposed, s.position_accepted))
    assert all(a >= b for a, b in zip(s.position_accepted, s.position_accepted[1:]))  # accepting k+1 needs k
    assert min(s.draft_s, s.rollout_s, s.verify_s, s.prefill_s) > 0
    assert s.draft_s + s.rollout_s + s.verify_s + s.prefill_s <= s.total_s


def test_crop_kv_works_with_this_transformers_and_refuses_growth(target):
    from transformers import DynamicCache

    kv = DynamicCache()
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), **{cache_argument(target.model): kv})
    crop_kv(kv, 5)
    assert kv_length(kv) == 5
    crop_kv(kv, 2)
    assert kv_length(kv) == 2 and kv.layers[0].keys.shape[2] == 2
    with pytest.raises(ValueError, match="cannot crop"):
        crop_kv(kv, 3)


@pytest.mark.parametrize("mode", ["dflash", "domino"])
def test_first_round_drafts_follow_the_block_layout(target, draft, monkeypatch, mode):
    """Slot j of the block [x_T, MASK x (B-1)] sits at position T+j and sees the prompt's features
    at positions 0..T-1 (computed here without the engine's cache); a shifted layout is silent in
    the lossless tests (it only lowers τ), so the base logits and proposals are checked directly."""
    engine = SpecEngine(target, draft, mode, params=engine_params())
    base_seen, proposals = [], []
    engine.runners.draft_lm_head = lambda z: base_seen.append(target.lm_head(z)) or base_seen[-1]
    accept = accept_module.accept_greedy
    monkeypatch.setattr(accept_module, "accept_greedy",
                        lambda ids, parents, logits: proposals.append(ids[1:].tolist()) or accept(ids, parents, logits))
    prompt = [3, 6, 4, 5, 7, 3]
    T, B = len(prompt), draft.config.block_size
    engine.generate(prompt, 20)

    with torch.inference_mode():
        full = target.model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
        features = torch.cat([full.hidden_states[l + 1] for l in draft.config.target_layer_ids], -1)  # [1, T, n*H]
        first = full.logits[0, -1].argmax()
        mask = torch.full((B - 1,), draft.config.mask_token_id)
        block = target.embed_tokens(torch.cat([first[None], mask]))[None]  # [1, B, H]
        z = draft(block, torch.arange(T, T + B)[None], target_features=features)[0, : B - 1]  # no cache
        base_logits = target.lm_head(z)
        if mode == "dflash":
            expected = base_logits.argmax(-1).tolist()
        else:
            expected = draft.rollout(z, base_logits, first[None], target.embed_tokens).tokens.tolist()
    torch.testing.assert_close(base_seen[0], base_logits, rtol=1e-9, atol=1e-9)
    assert proposals[0] == expected


def test_end_of_turn_token_of_the_chat_template_stops_generation():
    """A template closing assistant turns with a special token other than EOS adds it to the stops."""
    from engine_helpers import tiny_tokenizer

    from dominospec.stops import end_of_turn_id

    tokenizer = tiny_tokenizer(8)
    tokenizer.chat_template = "{% for m in messages %}t3 {{ m['content'] }} t7 {% endfor %}"
    assert end_of_turn_id(tokenizer) is None  # t7 is an ordinary token: not a stop
    tokenizer.add_special_tokens({"additional_special_tokens": ["t7"]})
    assert end_of_turn_id(tokenizer) == 7
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    target.tokenizer = tokenizer
    engine = SpecEngine(target, None, "ar", params=engine_params())
    assert engine.stop_ids == {EOS, 7}
    out = next(o for o in (engine.generate(p, 40) for p in random_prompts(20, 8, seed=9)) if 7 in o.token_ids)
    assert out.token_ids[-1] == 7 and out.finish_reason == "stop_token"
