"""The engine's streaming hook `generate(..., on_tokens=...)`, on tiny fp64 targets.

- The chunks handed to `on_tokens` (one after the first token, one per round) concatenate to the
  returned token_ids, in every mode, with stop tokens, budgets and stop strings; the result is the
  same as without the hook.
- `on_tokens` returning False ends the generation at once with finish_reason "abort", the caches
  still holding exactly the committed prefix.
Run: python -m pytest tests/engine/test_streaming.py -q
"""

import pytest
from engine_helpers import engine_params, random_prompts

from dominospec.engine import Sampling, SpecEngine


def streamed(engine: SpecEngine, prompt, max_new_tokens, **kwargs):
    """-> (Generation, chunks handed to on_tokens)."""
    chunks: list[list[int]] = []

    def on_tokens(ids: list[int]) -> bool:
        chunks.append(list(ids))
        return True

    return engine.generate(prompt, max_new_tokens, on_tokens=on_tokens, **kwargs), chunks


@pytest.mark.parametrize("mode", ["ar", "dflash", "domino"])
def test_chunks_concatenate_to_the_token_ids(target, draft, mode):
    engine = SpecEngine(target, None if mode == "ar" else draft, mode, params=engine_params())
    finishes = set()
    for prompt in random_prompts(8, 8, seed=11):
        plain = engine.generate(prompt, 30)
        out, chunks = streamed(engine, prompt, 30)
        assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason
        assert all(chunks) and sum(chunks, []) == out.token_ids
        assert len(chunks) == out.stats.rounds + 1  # the prefill's token, then one chunk per round
        if mode != "ar":
            assert [len(c) for c in chunks[1:]] == out.stats.accepted_lengths
        finishes.add(out.finish_reason)
    assert finishes == {"stop_token", "length"}


def test_chunks_respect_budgets_stop_strings_and_sampling(target, draft):
    engine = SpecEngine(target, draft, "domino", params=engine_params())
    engine.stop_ids = frozenset()
    prompt = [4, 4, 7]
    for budget in (1, 2, 5, 13):
        out, chunks = streamed(engine, prompt, budget)
        assert sum(chunks, []) == out.token_ids and len(out.token_ids) == budget
    free = engine.generate(prompt, 30).text
    stop = free.split()[5]
    out, chunks = streamed(engine, prompt, 30, stop_strings=[stop])
    assert out.finish_reason == "stop_string" and sum(chunks, []) == out.token_ids
    sampled, chunks = streamed(engine, prompt, 20, sampling=Sampling(temperature=1.0), seed=3)
    assert sum(chunks, []) == sampled.token_ids
    assert sampled.token_ids == engine.generate(prompt, 20, Sampling(temperature=1.0), seed=3).token_ids


@pytest.mark.parametrize("mode", ["ar", "domino"])
def test_returning_false_aborts(target, draft, mode):
    engine = SpecEngine(target, None if mode == "ar" else draft, mode, params=engine_params())
    engine.stop_ids = frozenset()
    prompt = [3, 5, 7]
    full = engine.generate(prompt, 40)
    for calls_allowed in (1, 3):
        chunks: list[list[int]] = []

        def on_tokens(ids: list[int]) -> bool:
            chunks.append(list(ids))
            return len(chunks) < calls_allowed

        out = engine.generate(prompt, 40, on_tokens=on_tokens)
        assert out.finish_reason == "abort" and len(chunks) == calls_allowed
        assert sum(chunks, []) == out.token_ids == full.token_ids[: len(out.token_ids)]
        assert out.stats.rounds == calls_allowed - 1
        assert out.stats.target_kv_length == len(prompt) + len(out.token_ids) - 1
        if mode != "ar":
            assert out.stats.draft_context_length == out.stats.target_kv_length


def test_false_on_the_last_step_keeps_the_natural_finish(target, draft):
    engine = SpecEngine(target, draft, "domino", params=engine_params())
    engine.stop_ids = frozenset()
    out = engine.generate([3, 5, 7], 1, on_tokens=lambda ids: False)
    assert out.finish_reason == "length" and len(out.token_ids) == 1
