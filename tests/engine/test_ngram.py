"""Prompt lookup (`ngram` mode): the index against a brute-force reference, and losslessness.

- `NgramIndex.propose` equals a kernel-free scan: the longest suffix n-gram (max..min) with an
  earlier occurrence, its most recent one, the k tokens after it.
- Greedy `ngram` decoding equals AR token for token (fp32 / fp64 tiny targets), with a fixed K and
  with auto-K; the prompts repeat themselves, so lookups hit and drafts are accepted (counted).
- `ngram_assist` (a draft mode verifying prompt-lookup hits instead of drafting) equals AR too,
  with both kinds of round happening, and keeps the draft context in step with the target KV.
  Its lookups run to `ngram_num_draft` whatever the block size, learn in their own auto-K model,
  and stay out of the draft's acceptance by position.
Run: python -m pytest tests/engine/test_ngram.py -q
"""

import random

import pytest
import torch
from engine_helpers import engine_params, random_prompts, repetitive_prompts, stats_equal_to_ar, streaming_cost, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.engine.ngram import NgramIndex


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: for n = max..min, scan right to left for an earlier occurrence of the suffix."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for stop in range(end - 1, n - 1, -1):  # occurrence ending at `stop` (exclusive), before the suffix
            if tokens[stop - n:stop] == suffix:
                return tokens[stop:stop + k]
    return []


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (1, 4), (2, 3)])
def test_index_matches_brute_force(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        index = NgramIndex(min_n, max_n)
        cut = rng.randrange(len(tokens) + 1)
        index.extend(tokens[:cut])  # built in two pushes, as the engine does
        index.extend(tokens[cut:])
        k = rng.randrange(0, 9)
        assert index.propose(k) == reference_propose(tokens, k, min_n, max_n), (tokens, k)



@pytest.mark.parametrize("arch, vocab, dtype", [("llama", 8, torch.float64), ("qwen3", 96, torch.float32)])
@pytest.mark.parametrize("num_draft", [None, 3, "auto"])
def test_greedy_ngram_equals_ar(arch, vocab, dtype, num_draft):
    target = tiny_target(arch, vocab=vocab, dtype=dtype, scale=0.2)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    engine = SpecEngine(target, None, "ngram", num_draft, engine_params(ngram_max=3))
    engine.cost = streaming_cost(engine.max_verify)  # auto-K: a fixed cost table, not this machine's timing
    accepted = lookups = 0
    for prompt in repetitive_prompts(10, vocab, seed=vocab) + random_prompts(4, vocab, seed=1):
        expected = ar.generate(prompt, 24).token_ids
        out = engine.generate(prompt, 24)
        assert out.token_ids == expected, prompt
        assert out.stats.round_tokens + 1 == len(expected)
        accepted += sum(out.stats.position_accepted)
        lookups += out.stats.draft_rounds
    assert lookups > 10 and accepted > 10, (lookups, accepted)


@pytest.mark.parametrize("mode", ["domino", "dflash"])
@pytest.mark.parametrize("num_draft", [None, "auto"])
def test_greedy_ngram_assist_equals_ar(mode, num_draft):
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    engine = SpecEngine(target, draft, mode, num_draft, engine_params(ngram_assist=True, ngram_max=3))
    engine.cost = streaming_cost(engine.max_verify)  # auto-K: a fixed cost table, not this machine's timing
    stats = stats_equal_to_ar(engine, ar)
    lookups = sum(s.lookup_rounds for s in stats)
    drafted = sum(s.draft_rounds - s.lookup_rounds for s in stats)
    assert lookups > 10 and drafted > 10, (lookups, drafted)


@pytest.mark.parametrize("num_draft", [None, "auto"])
def test_assisting_lookups_run_past_the_block(num_draft):
    """B = 4 caps the draft's chain at 3 drafts, not a lookup: on prompts that repeat, some lookup
    round emits more than B tokens. By position counts only the draft's chains."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    engine = SpecEngine(target, draft, "domino", num_draft, engine_params(ngram_assist=True, ngram_max=3, ngram_num_draft=7))
    assert engine.num_draft == 3 and engine.lookup_k_max == 7 and engine.max_verify == 7
    engine.cost = streaming_cost(engine.max_verify)  # auto-K: a fixed cost table, not this machine's timing
    longest, chains, first_position = 0, 0, 0
    for prompt in repetitive_prompts(8, 8, seed=3) + random_prompts(12, 8, seed=2):
        out = engine.generate(prompt, 32)
        assert out.token_ids == ar.generate(prompt, 32).token_ids, prompt
        longest = max([longest, *out.stats.accepted_lengths])
        chains += out.stats.draft_rounds - out.stats.lookup_rounds
        first_position += out.stats.position_proposed[0]
        assert len(out.stats.position_proposed) == 3
    assert longest > 4, longest
    assert first_position == chains > 10  # every chain proposes a first draft; no lookup is counted


def test_assist_keeps_separate_acceptance_for_lookups_and_chains():
    """auto-K: a lookup round teaches the lookup model (up to 7 positions), a chain the draft's (3)."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    engine = SpecEngine(target, draft, "domino", "auto", engine_params(ngram_assist=True, ngram_max=3))
    engine.calibrate(random_prompts(1, 8, seed=9)[0])
    assert len(engine.cost.verify) == 8  # verify of up to 7 lookup tokens is measured too
    out = engine.generate(repetitive_prompts(1, 8, seed=3)[0] * 2, 40)
    lookups, chains = engine.proposer.lookup_acceptance, engine.proposer.acceptance
    assert lookups is not chains and lookups.k_max == 7 and chains.k_max == 3
    assert out.stats.lookup_rounds > 0 and sum(lookups.tried) > 0
    if out.stats.draft_rounds == out.stats.lookup_rounds:  # no chain ran: the draft's model only aged
        assert sum(chains.tried) == 0


@pytest.mark.parametrize("mode", ["ngram", "domino"])
def test_lookup_rounds_count_in_the_draft_round_time(mode):
    """A round that verified a lookup is a draft round in the timing too (eval.json's
    draft_round_ms = draft_round_s ÷ draft_rounds), and no more time is counted than the rounds took."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True) if mode == "domino" else None
    options = engine_params(ngram_assist=mode == "domino", ngram_max=3)
    engine = SpecEngine(target, draft, mode, None, options)
    lookups = 0
    for prompt in repetitive_prompts(8, 8, seed=3):
        stats = engine.generate(prompt, 24).stats
        lookups += stats.lookup_rounds if mode == "domino" else stats.draft_rounds
        assert (stats.draft_round_s > 0) == (stats.draft_rounds > 0)
        assert stats.draft_round_s <= stats.draft_s + stats.rollout_s + stats.verify_s + 1e-9
        if stats.draft_rounds == stats.rounds:  # every round proposed: all of the rounds' time
            assert stats.draft_round_s == pytest.approx(stats.draft_s + stats.rollout_s + stats.verify_s)
    assert lookups > 5
