"""engine.cost: a round cost measured once can be shared by the engines evaluate compares."""

import torch
from engine_helpers import engine_params, random_prompts, tiny_draft, tiny_target

from dominospec.engine import SpecEngine
from dominospec.engine.policy import RoundCost


def _engines():
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    options = engine_params(ngram_assist=True, ngram_max=3, tree=dict(shape="best_first", nodes=4))
    return (SpecEngine(target, draft, "domino", "auto", options), SpecEngine(target, draft, "dflash", "auto", options),
            SpecEngine(target, None, "ngram", "auto", options))


def test_a_shared_cost_gives_its_verify_and_draft_and_measures_the_own_rollout():
    domino, dflash, ngram = _engines()
    prompt = random_prompts(1, 8, seed=9)[0]
    lead = domino.calibrate(prompt)
    side = dflash.calibrate(prompt, shared=lead)
    assert side.verify == lead.verify[:dflash.max_verify + 1] and side.draft == lead.draft
    assert lead.tree_build > 0 and side.tree_build == 0.0  # DominoTree's build: the tree engine's own
    assert side.rollout_step > 0  # measured on the head-off rollout, not copied
    lookups = ngram.calibrate(prompt, shared=lead)
    assert lookups.verify == lead.verify[:ngram.max_verify + 1] and lookups.draft == 0.0 == lookups.rollout_step


def test_a_shared_cost_with_too_few_rows_is_measured_afresh():
    domino, dflash, _ = _engines()
    prompt = random_prompts(1, 8, seed=9)[0]
    short = RoundCost(verify=[1.0, 1.0], draft=123.0, rollout_step=1.0)
    cost = dflash.calibrate(prompt, shared=short)
    assert len(cost.verify) == dflash.max_verify + 1 and cost.draft != 123.0
