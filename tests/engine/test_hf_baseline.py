"""transformers' compiled `generate` as the GPU benchmark runs it (benchmarks/common/generate.py):
one StaticCache kept across calls, reset before each, so the graphs transformers records on CUDA never
see their static addresses move or go free; and its tokens equal plain greedy `generate`'s.
Run: python -m pytest tests/engine/test_hf_baseline.py -q
"""

import torch

from common.generate import StaticGenerate
from engine_helpers import EOS, tiny_target


def test_static_generate_keeps_one_cache_and_matches_plain_generate():
    target = tiny_target()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (17, 5, 11)]
    baseline = StaticGenerate(target, [EOS], max(prompts, key=len), 24)
    first = baseline.cache.layers[0]
    keys, counter = first.keys.data_ptr(), first.cumulative_length.data_ptr()
    for prompt in prompts:
        tokens = baseline(prompt, 24)
        layer = baseline.cache.layers[0]
        assert layer.keys.data_ptr() == keys and layer.cumulative_length.data_ptr() == counter
        # the counter equals the rows this call wrote: reset before it, advanced once a step
        assert int(layer.cumulative_length) == len(prompt) + len(tokens) - 1
        ids = torch.tensor([prompt])
        plain = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                      do_sample=False, eos_token_id=[EOS], pad_token_id=EOS)
        expected = plain[0, len(prompt):].tolist()
        expected = expected[: expected.index(EOS) + 1] if EOS in expected else expected
        assert tokens == expected
