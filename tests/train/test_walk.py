"""The engine walk (validation τ) equals the engine's τ on the target's own greedy output.

fp64 tiny target and drafts (CPU, no hub): the engine generates greedily; the walk then scores
the same draft at every anchor of prompt + output, teacher-forced, and walks the reply round by
round. Pooled τ (emitted tokens and rounds) must match the engine exactly, with the head
on and off, for a draft fitted well enough to be accepted often (τ about 3).
Run: python -m pytest tests/train/test_walk.py -q
"""

import torch

from engine_helpers import engine_params, random_prompts, tiny_draft, tiny_target  # noqa: E402

from dominospec.cache.features import target_hidden  # noqa: E402
from dominospec.engine import SpecEngine  # noqa: E402
from dominospec.train import objective as O  # noqa: E402
from dominospec.train.walk import WalkStats, reply_spans, walk_reply, walk_sequence, walked_spans  # noqa: E402

LAYER_IDS = [0, 2]


def test_reply_spans_and_walk_rules():
    assert reply_spans(torch.tensor([0, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)) == [(1, 3), (5, 8)]
    # reply at 0..9 (10 tokens), K = 3: accepted 3 at 0 -> a = 4; accepted 0 at 4 -> a = 5; 3 at 5 -> 9 stops
    stats = walk_reply({0: 3, 4: 0, 5: 3, 9: 0}, 0, 10, 3)
    assert (stats.emitted, stats.rounds) == (9, 3)
    assert stats.position_accepted == [2, 2, 2] and stats.position_proposed == [3, 3, 3]
    # near the end the engine proposes room - 1 drafts: at a = 7 of a 9-token reply none (a plain step)
    stats = walk_reply({0: 3, 4: 2, 7: 3}, 0, 9, 3)
    assert (stats.emitted, stats.rounds) == (8, 3) and stats.position_proposed == [2, 2, 2]
    stats = walk_reply({0: 3, 4: 1, 6: 3}, 0, 9, 3)  # at a = 6: room 2, one draft proposed
    assert (stats.emitted, stats.rounds) == (8, 3) and stats.position_proposed == [3, 2, 2]


def _sequence(target, prompt: list[int], reply: list[int]):
    """-> ids [T], loss_mask [T] (the reply), target features [T, n*H] for LAYER_IDS."""
    ids = torch.tensor(prompt + reply)
    loss_mask = torch.zeros(len(ids), dtype=torch.bool)
    loss_mask[len(prompt):] = True
    feats = target_hidden(target.model, ids[None], torch.ones(1, len(ids), dtype=torch.long), LAYER_IDS)[0].clone()
    return ids, loss_mask, feats


def _fitted_draft(target, prompts, head: bool):
    """A tiny draft fitted for a few steps to the target's greedy replies, so that it is often right."""
    replies = [SpecEngine(target, None, "ar", params=engine_params()).generate(p, 30).token_ids for p in prompts]
    seqs = [_sequence(target, p, r) for p, r in zip(prompts, replies)]
    draft = tiny_draft(target, block_size=5, head=head, scale=0.1,
                       dflash_config=dict(mask_token_id=23, target_layer_ids=LAYER_IDS, gru_hidden_dim=16, emb_dim=8))
    draft.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    weights = O.position_weights(5, 4.0)
    for step in range(60):
        loss = 0.0
        for ids, loss_mask, feats in seqs:
            blocks = O.make_blocks(ids[None], loss_mask[None], 16, 5, 23, torch.Generator().manual_seed(step))
            base, final = O.draft_block_logits(draft, target.embed_tokens, target.lm_head, feats[None], blocks)
            loss = loss + O.domino_loss(base, final, blocks.labels, blocks.label_mask, weights, 0.5)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval().requires_grad_(False)


def _engine_and_walk(head: bool, horizon=None):
    """-> the engine's counts over 30 new tokens (`horizon` tokens when given), and the walk's over
    the 30-token replies (cut to `horizon`)."""
    target = tiny_target(vocab=24, dtype=torch.float64, scale=0.5)
    prompts = random_prompts(6, 24, seed=3, min_len=3, max_len=8)
    draft = _fitted_draft(target, prompts, head)
    engine = SpecEngine(target, draft, "domino" if head else "dflash", params=engine_params())
    engine_total, walk_total = WalkStats(position_accepted=[0] * 4, position_proposed=[0] * 4), WalkStats()
    for prompt in prompts:
        out = engine.generate(prompt, horizon or 30)
        engine_total.emitted += out.stats.round_tokens
        engine_total.rounds += out.stats.rounds
        engine_total.position_accepted = [a + b for a, b in zip(engine_total.position_accepted, out.stats.position_accepted)]
        engine_total.position_proposed = [a + b for a, b in zip(engine_total.position_proposed, out.stats.position_proposed)]
        reply = out.token_ids if horizon is None else engine.generate(prompt, 30).token_ids
        ids, loss_mask, feats = _sequence(target, prompt, reply)
        walk_total.merge(walk_sequence(draft, target.embed_tokens, target.lm_head, ids, loss_mask, feats,
                                       num_draft=4, head=head, chunk=7, horizon=horizon))
    return engine_total, walk_total


def test_walk_equals_engine_head_on_and_off():
    for head in (True, False):
        engine, walk = _engine_and_walk(head)
        assert walk.rounds == engine.rounds and walk.emitted == engine.emitted, head
        # Accepted/proposed counts by position may differ in a reply's last round only: the engine
        # does not know a stop token comes next and verifies drafts beyond it.
        assert 1.2 < walk.acceptance_length < 4.5, walk.acceptance_length  # the drafts do get accepted


def test_walk_to_a_horizon_equals_the_engine_decoding_that_many_tokens():
    """A val reply longer than evaluate's answers: walked to h tokens it reads what the engine reads
    decoding h tokens (the rounds of the longer reply's rest are not counted)."""
    for head in (True, False):
        engine, walk = _engine_and_walk(head, horizon=17)
        assert walk.rounds == engine.rounds and walk.emitted == engine.emitted, head
        _, whole = _engine_and_walk(head)
        assert walk.emitted < whole.emitted, (walk.emitted, whole.emitted)  # the horizon did cut the replies


def test_walked_spans():
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert walked_spans(mask) == [(1, 6)]
    assert walked_spans(mask, first_reply_only=False) == [(1, 6), (7, 10)]
    assert walked_spans(mask, first_reply_only=False, horizon=2) == [(1, 3), (7, 9)]
    assert walked_spans(mask, horizon=1) == []  # a one-token reply offers no round
    assert walked_spans(torch.tensor([0, 1, 0, 1, 1], dtype=torch.bool)) == [(3, 5)]  # too short ones skipped first
