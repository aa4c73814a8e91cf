"""The default decoding on the real embedded target: params.yaml's `engine:` as the evaluation resolves it.

SmolLM2-135M-Instruct (the packaged GGUF, fp32 CPU) and a draft of the default architecture
(params `draft:`, a narrower MLP) trained here, with the project's objective, on the target's own
greedy replies to the test's prompts, until it accepts deep. The default mode `domino` must resolve
to DominoTree (best_first) with the prompt-lookup fork; on 4 prompts x 64 new tokens it equals AR
token for token, at its whole tree budget with its drafts accepted (pooled τ > 1.3, the tree's own
tokens among them), and with auto-K as evaluate runs it (whose drafting follows the host's timings:
on a loaded or bf16-emulating 2-core host it verified few nodes, pooled τ 1.4, the same draft 2.3
at the whole budget).
Run: python -m pytest tests/engine/test_default_decoding.py -q
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import chat_ids, fit_draft

from dominospec.cache.features import resolve_layer_ids
from dominospec.config import load_params
from dominospec.engine import SpecEngine
from dominospec.runtime.prepare import prepare_target
from dominospec.engine.proposers import BestFirstTrees
from dominospec.models.domino import DFlashDraftModel
from dominospec.target import load_target
from dominospec.train.build import draft_config

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Describe how a bicycle works.", "Write a haiku about autumn leaves.",
           "Give three tips for staying healthy.", "Explain what a prime number is."]
NEW_TOKENS, STEPS = 64, 100

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_setup():
    """-> (params, target with engine.linear resolved, the resolved engine params, prompts, AR replies, a trained draft)."""
    torch.manual_seed(0)
    params = load_params(REPO / "params.yaml")
    target = load_target(params.target)
    options = dataclasses.replace(params.engine, linear=prepare_target(target, params.engine))  # as evaluate resolves it
    ar = SpecEngine(target, None, "ar", None, options)
    prompts = [chat_ids(target, text) for text in PROMPTS]
    replies = [ar.generate(p, NEW_TOKENS).token_ids for p in prompts]
    assert all(len(r) == NEW_TOKENS for r in replies), "every reply runs the whole budget"
    draft = trained_draft(params, target, prompts, replies)
    return params, target, options, prompts, replies, draft


def trained_draft(params, target, prompts: list[list[int]], replies: list[list[int]]) -> DFlashDraftModel:
    """The default draft architecture (params `draft:`, its MLP 256 wide) trained STEPS steps on the
    replies (engine_helpers.fit_draft, a sampled softmax of 1,024 negatives) -> the draft, fp32, frozen."""
    mask_id = target.tokenizer.convert_tokens_to_ids("<|endoftext|>")  # never in a chat reply
    layer_ids = resolve_layer_ids(params.cache, target.num_layers)
    torch.manual_seed(0)
    draft = DFlashDraftModel(draft_config(dataclasses.replace(params.draft, intermediate_size=256), target, layer_ids,
                                          mask_id))
    return fit_draft(target, draft, prompts, replies, STEPS, lr=3e-3, negatives=1024, gamma=params.train.loss_gamma)


def test_default_mode_resolves_to_dominotree_with_the_fork(default_setup):
    params, target, options, _, _, draft = default_setup
    engine = SpecEngine(target, draft, "domino", params.evaluate.num_draft, options)
    assert engine.mode == "dominotree" and isinstance(engine.proposer, BestFirstTrees)
    assert engine.nodes == params.engine.tree.nodes > 1
    assert engine.proposer.fork and engine.lookup_k_max == params.engine.ngram_num_draft > 0


def decode_all(engine: SpecEngine, target, prompts, replies) -> tuple[int, int, int]:
    """Every prompt decoded by `engine`, each equal to AR's reply token for token -> (tokens emitted,
    rounds, the tree's own drafts accepted: lookups left out)."""
    emitted = rounds = tree_tokens = 0
    for prompt, reply in zip(prompts, replies):
        out = engine.generate(prompt, NEW_TOKENS)
        assert out.token_ids == reply, target.tokenizer.decode(prompt)
        stats = out.stats
        assert stats.target_kv_length == stats.draft_context_length == len(prompt) + len(reply) - 1
        emitted += sum(stats.accepted_lengths)
        rounds += stats.rounds
        tree_tokens += sum(stats.position_accepted)
    return emitted, rounds, tree_tokens


def test_default_greedy_equals_ar_with_drafts_accepted(default_setup):
    """The default tree at its whole budget (K_max = engine.tree.nodes): what it accepts is a function
    of the draft alone, not of this machine's timings, so τ is asserted here."""
    params, target, options, prompts, replies, draft = default_setup
    engine = SpecEngine(target, draft, "domino", None, options)
    emitted, rounds, tree_tokens = decode_all(engine, target, prompts, replies)
    tau = emitted / rounds
    assert tau > 1.3, f"pooled τ {tau:.2f}: the drafts were hardly accepted"
    assert tree_tokens > 0.3 * rounds, f"{tree_tokens} tree drafts accepted in {rounds} rounds"


def test_default_with_auto_k_equals_ar(default_setup):
    """As evaluate resolves it (num_draft: auto): auto-K verifies the best n of the budget by this
    machine's measured costs, so how much it drafts follows the host's load; its tokens never do."""
    params, target, options, prompts, replies, draft = default_setup
    assert params.evaluate.num_draft == "auto"
    engine = SpecEngine(target, draft, "domino", params.evaluate.num_draft, options)
    emitted, rounds, _ = decode_all(engine, target, prompts, replies)
    assert emitted == len(prompts) * (NEW_TOKENS - 1) and rounds <= emitted  # the prefill emits each first token
