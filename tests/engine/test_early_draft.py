"""engine.early_draft: the next round's draft block, queued as soon as a round's tokens are known,
changes when the device drafts, never what: the same tokens, the same rounds, the same drafts.

On a GPU the block then runs while the host books the round (tokens, stats, auto-K's update) and
plans the next; on CPU the block simply runs earlier, so everything but the overlap is checked
here, greedy and sampled, on the dynamic and the static caches, with auto-K (whose plain steps
discard a queued block) and prompt lookups (whose lookup-only rounds do too).
Run: python -m pytest tests/engine/test_early_draft.py -q
"""

import dataclasses

import pytest
import torch
from engine_helpers import random_prompts, repetitive_prompts, streaming_cost

from dominospec.engine import EngineOptions, SpecEngine
from dominospec.engine.sampling import Sampling


@pytest.mark.parametrize("mode, num_draft, options", [
    ("domino", None, {}),
    ("domino", 3, dict(static_cache=True, graph_capacity=128)),
    ("domino", "auto", dict(ngram_assist=True)),
    ("domino", "auto", dict(ngram_assist=True, ngram_fork=True, tree_width=3, static_cache=True, graph_capacity=128)),
    ("dflash", None, dict(ngram_assist=True, static_cache=True, graph_capacity=128, lean_target="on")),
])
def test_early_draft_changes_nothing_but_when(target, draft, mode, num_draft, options):
    late = SpecEngine(target, draft, mode, num_draft, EngineOptions(early_draft=False, **options))
    early = SpecEngine(target, draft, mode, num_draft, EngineOptions(early_draft=True, **options))
    assert early.early_draft and not late.early_draft
    if num_draft == "auto":  # one fixed cost table: both choose from the same costs
        late.cost = early.cost = streaming_cost(late.max_verify)
    for prompt in repetitive_prompts(4, 8, seed=3) + random_prompts(4, 8, seed=2):
        a, b = late.generate(prompt, 24), early.generate(prompt, 24)
        assert b.token_ids == a.token_ids, prompt
        assert b.stats.accepted_lengths == a.stats.accepted_lengths
        assert b.stats.position_proposed == a.stats.position_proposed
        assert b.stats.draft_context_length == b.stats.target_kv_length == len(prompt) + len(b.token_ids) - 1


def test_early_draft_sampled_draws_the_same(target, draft):
    sampling = Sampling(temperature=0.8, top_p=0.95)
    late = SpecEngine(target, draft, "domino", None, EngineOptions(early_draft=False))
    early = SpecEngine(target, draft, "domino", None, EngineOptions(early_draft=True))
    for i, prompt in enumerate(random_prompts(4, 8, seed=5)):
        a, b = late.generate(prompt, 24, sampling, seed=i), early.generate(prompt, 24, sampling, seed=i)
        assert b.token_ids == a.token_ids and b.stats.accepted_lengths == a.stats.accepted_lengths


def test_early_draft_is_on_with_cuda_by_default(target, draft):
    engine = SpecEngine(target, draft, "domino", None, EngineOptions())
    assert engine.early_draft == (engine.device.type == "cuda")
    assert not SpecEngine(target, None, "ar", None, EngineOptions(early_draft=True)).early_draft  # nothing to draft
