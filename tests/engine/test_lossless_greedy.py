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
from engine_helpers import random_prompts, tiny_draft, tiny_target

from dominospec.engine import SpecEngine


CASES = [  # arch, vocab, dtype, block sizes
    ("llama", 8, torch.float64, (2, 4, 8)),
    ("qwen3", 8, torch.float32, (2, 4, 8)),
    ("llama", 96, torch.float32, (4,)),
    ("qwen3", 96, torch.float64, (4,)),
]


@pytest.mark.parametrize("arch, vocab, dtype, block_sizes", CASES)
def test_greedy_spec_equals_ar(arch, vocab, dtype, block_sizes):
    target = tiny_target(arch, vocab=vocab, dtype=dtype, scale=0.2)
    ar = SpecEngine(target, None, "ar")
    prompts = random_prompts(12, vocab, seed=vocab)
    reference = [ar.generate(p, 24).token_ids for p in prompts]
    assert any(len(r) == 24 for r in reference), "every answer stopped early: the test would be weak"
    accepted = full_blocks = 0
    for block_size in block_sizes:
        draft = tiny_draft(target, block_size=block_size, seed=block_size)
        for mode in ("dflash", "domino"):
            engine = SpecEngine(target, draft, mode)
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
    dflash, domino = SpecEngine(target, draft, "dflash"), SpecEngine(target, draft, "domino")
    prompts = random_prompts(8, 8, seed=1)
    rounds_differ = 0
    for prompt in prompts:
        a, b = dflash.generate(prompt, 24), domino.generate(prompt, 24)
        assert a.token_ids == b.token_ids
        rounds_differ += a.stats.accepted_lengths != b.stats.accepted_lengths
    assert rounds_differ > 0
