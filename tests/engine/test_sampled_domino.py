"""`domino` on best_first samples its chain; `dominotree` samples its tree (engine.decoding's `sampled_chain`).

Sampled at T = 0.7 on one H100 DominoTree bought no τ over its chain (docs/design.md, "DominoTree"), so
the resolve step gives `domino` the head's chain for sampled requests and keeps the tree for greedy ones:
- a `domino` engine's sampled answers equal, token for token and round for round, those of a `domino`
  engine on engine.tree.shape chain with the same seed; its greedy answers equal mode `dominotree`'s;
- mode `dominotree` still grows its tree when sampling (rounds that verify more than one node).
Run: python -m pytest tests/engine/test_sampled_domino.py -q
"""

import torch
from engine_helpers import engine_params, random_prompts, tiny_draft, tiny_target

from dominospec.engine import Sampling, SpecEngine
from dominospec.engine.proposers import BestFirstTrees, DraftChains

TREE = engine_params(tree=dict(nodes=9, children=3))
SAMPLED = Sampling(temperature=0.7)


def test_domino_samples_its_chain_and_keeps_the_tree_greedy():
    target = tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=4, head=True)
    domino = SpecEngine(target, draft, "domino", None, TREE.with_tree(shape="best_first"))
    chain = SpecEngine(target, draft, "domino", None, TREE.with_tree(shape="chain"))
    tree = SpecEngine(target, draft, "dominotree", None, TREE.with_tree(shape="chain"))
    assert domino.decoding.sampled_chain and not tree.decoding.sampled_chain and not chain.decoding.sampled_chain
    assert isinstance(domino.proposer, BestFirstTrees) and isinstance(domino.sampled_proposer, DraftChains)
    assert tree.sampled_proposer is tree.proposer
    tree_rounds = 0
    for i, prompt in enumerate(random_prompts(3, 8, seed=5)):
        a, b = domino.generate(prompt, 16, SAMPLED, seed=i), chain.generate(prompt, 16, SAMPLED, seed=i)
        assert a.token_ids == b.token_ids and a.stats.accepted_lengths == b.stats.accepted_lengths
        assert a.stats.tree_rounds == 0
        tree_rounds += tree.generate(prompt, 16, SAMPLED, seed=i).stats.tree_rounds
        greedy, expected = domino.generate(prompt, 16), tree.generate(prompt, 16)
        assert greedy.token_ids == expected.token_ids and greedy.stats.tree_rounds == expected.stats.tree_rounds
    assert tree_rounds > 0, "sampled dominotree verified no tree: the test would not see it drop the tree"
