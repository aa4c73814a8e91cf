"""Prompt lookup (`ngram` mode): the index against a brute-force reference, and losslessness.

- `NgramIndex.propose` equals a kernel-free scan: the longest suffix n-gram (max..min) with an
  earlier occurrence, its most recent one, the k tokens after it.
- Greedy `ngram` decoding equals AR token for token (fp32 / fp64 tiny targets), with a fixed K and
  with auto-K; the prompts repeat themselves, so lookups hit and drafts are accepted (counted).
- `ngram_assist` (a draft mode verifying prompt-lookup hits instead of drafting) equals AR too,
  with both kinds of round happening, and keeps the draft context in step with the target KV.
Run: python -m pytest tests/engine/test_ngram.py -q
"""

import random

import pytest
import torch
from engine_helpers import random_prompts, tiny_draft, tiny_target

from dominospec.engine import EngineOptions, SpecEngine
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


def repetitive_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts made of a short random phrase repeated: prompt lookup has something to find."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [g.randrange(3, vocab - 1) for _ in range(g.randrange(2, 6))]
        out.append((phrase * 4)[: g.randrange(6, 20)])
    return out


@pytest.mark.parametrize("arch, vocab, dtype", [("llama", 8, torch.float64), ("qwen3", 96, torch.float32)])
@pytest.mark.parametrize("num_draft", [None, 3, "auto"])
def test_greedy_ngram_equals_ar(arch, vocab, dtype, num_draft):
    target = tiny_target(arch, vocab=vocab, dtype=dtype, scale=0.2)
    ar = SpecEngine(target, None, "ar")
    engine = SpecEngine(target, None, "ngram", num_draft, EngineOptions(ngram_max=3))
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
    ar = SpecEngine(target, None, "ar")
    engine = SpecEngine(target, draft, mode, num_draft, EngineOptions(ngram_assist=True, ngram_max=3))
    lookups = drafted = 0
    for prompt in repetitive_prompts(8, 8, seed=3) + random_prompts(12, 8, seed=2):
        out = engine.generate(prompt, 24)
        assert out.token_ids == ar.generate(prompt, 24).token_ids, prompt
        assert out.stats.draft_context_length == out.stats.target_kv_length == len(prompt) + len(out.token_ids) - 1
        lookups += out.stats.lookup_rounds
        drafted += out.stats.draft_rounds - out.stats.lookup_rounds
    assert lookups > 10 and drafted > 10, (lookups, drafted)
