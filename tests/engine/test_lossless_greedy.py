"""Greedy speculative decoding is lossless: spec output == AR output, token for token.

Tiny random Llama (tied embeddings) and Qwen3 (untied) targets in fp32 and fp64, random drafts,
head on (`domino`) and off (`dflash`), block sizes 2, 4 and 8, many random prompts. Vocabulary 8
makes random drafts right often enough that multi-token acceptance, full blocks and corrections
all occur (checked), vocabulary 96 makes them mostly wrong. A draft that is never accepted would
make the test vacuous, so acceptance is counted.
Run: python -m pytest tests/engine/test_lossless_greedy.py -q
"""

import pytest
import torch
from engine_helpers import engine_params, random_prompts, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.runtime.packed import pack_linears


CASES = [  # arch, vocab, dtype, block sizes
    ("llama", 8, torch.float64, (2, 4, 8)),
    ("qwen3", 8, torch.float32, (2, 4, 8)),
    ("llama", 96, torch.float32, (4,)),
    ("qwen3", 96, torch.float64, (4,)),
]


@pytest.mark.parametrize("arch, vocab, dtype, block_sizes", CASES)
def test_greedy_spec_equals_ar(arch, vocab, dtype, block_sizes):
    target = tiny_target(arch, vocab=vocab, dtype=dtype, scale=0.2)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    prompts = random_prompts(12, vocab, seed=vocab)
    reference = [ar.generate(p, 24).token_ids for p in prompts]
    assert any(len(r) == 24 for r in reference), "every answer stopped early: the test would be weak"
    accepted = full_blocks = 0
    for block_size in block_sizes:
        draft = tiny_draft(target, block_size=block_size, seed=block_size)
        for mode in ("dflash", "domino"):
            engine = SpecEngine(target, draft, mode, params=engine_params())
            for prompt, expected in zip(prompts, reference):
                out = engine.generate(prompt, 24)
                assert out.token_ids == expected, (mode, block_size, prompt)
                assert out.stats.round_tokens + 1 == len(expected)
                accepted += sum(out.stats.position_accepted)
                full_blocks += out.stats.position_accepted[-1]
    if vocab == 8:
        assert accepted > 50 and full_blocks > 5, (accepted, full_blocks)


def test_domino_and_dflash_drafts_differ_but_both_are_lossless():
    """The head changes the proposals (else the comparison above would test one path twice)."""
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=8, seed=3)
    dflash, domino = SpecEngine(target, draft, "dflash", params=engine_params()), SpecEngine(target, draft, "domino", params=engine_params())
    prompts = random_prompts(8, 8, seed=1)
    rounds_differ = 0
    for prompt in prompts:
        a, b = dflash.generate(prompt, 24), domino.generate(prompt, 24)
        assert a.token_ids == b.token_ids
        rounds_differ += a.stats.accepted_lengths != b.stats.accepted_lengths
    assert rounds_differ > 0


FAST = [  # the engine's speed knobs: none may change a greedy token
    engine_params(draft_dtype="bfloat16"),
    engine_params(draft_dtype="bfloat16", linear="packed", candidate_pool=3),
    engine_params(candidate_pool=5, confidence_cut=0.2),
]


@pytest.mark.parametrize("arch, dtype", [("llama", torch.float32), ("qwen3", torch.float64)])
@pytest.mark.parametrize("options", FAST)
@pytest.mark.parametrize("num_draft", [None, "auto"])
def test_bf16_draft_pool_cut_and_auto_k_stay_lossless(arch, dtype, options, num_draft):
    target = tiny_target(arch, vocab=8, dtype=dtype, scale=0.2)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    prompts = random_prompts(10, 8, seed=5)
    reference = [ar.generate(p, 24).token_ids for p in prompts]
    draft = tiny_draft(target, block_size=8, seed=8)
    accepted = 0
    for mode in ("dflash", "domino"):
        engine = SpecEngine(target, draft, mode, num_draft, options)
        for prompt, expected in zip(prompts, reference):
            out = engine.generate(prompt, 24)
            assert out.token_ids == expected, (mode, prompt)
            accepted += sum(out.stats.position_accepted)
    if num_draft is None:
        assert accepted > 20, accepted


def test_packed_target_matches_plain_target():
    """`linear: packed` (oneDNN, weights packed once) gives the AR and spec tokens of the plain fp32 target."""
    target = tiny_target("qwen3", vocab=96, dtype=torch.float32, scale=0.2)
    prompts = random_prompts(8, 96, seed=2)
    reference = [SpecEngine(target, None, "ar", params=engine_params()).generate(p, 20).token_ids for p in prompts]
    draft = tiny_draft(target, block_size=4, seed=4)
    assert pack_linears(target.model) == 4 * 7 + 1  # q k v o gate up down per layer + lm_head
    for engine in (SpecEngine(target, None, "ar", params=engine_params()), SpecEngine(target, draft, "domino", None, FAST[1])):
        assert [engine.generate(p, 20).token_ids for p in prompts] == reference
