"""The training objective: anchors, label alignment, masks, losses, curriculum and metrics.

Label tests use a sequence with x[t+1] = x[t] + 1 and hand-written expectations, so a one-slot
shift anywhere (labels, GRU inputs, positions) fails them.
Run: python -m pytest tests/train/test_objective.py -q
"""

import math

import pytest
import torch

from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig, DraftContextCache
from dominospec.train import objective as O

M = 99  # mask token id in the hand-written examples


def test_labels_gru_inputs_and_positions_are_aligned():
    x = torch.arange(10, 20)  # x[t] = 10 + t, so x[t+1] = x[t] + 1
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    blocks = O.make_blocks(x[None], loss_mask[None], 0, 4, M, anchors=[torch.tensor([2, 7])])
    assert blocks.block_ids[0].tolist() == [[12, M, M, M], [17, M, M, M]]
    assert blocks.positions[0].tolist() == [[2, 3, 4, 5], [7, 8, 9, 10]]
    assert blocks.gru_ids[0].tolist() == [[12, 13, 14, 15], [17, 18, 19, 19]]
    labels, label_mask = blocks.labels[0], blocks.label_mask[0]
    assert labels[0].tolist() == [13, 14, 15, 16]
    assert label_mask[0].tolist() == [True, True, True, False]  # x[6] is not supervised
    assert labels[1, :2].tolist() == [18, 19]
    assert label_mask[1].tolist() == [True, True, False, False]  # positions 10, 11 are past the end


def test_anchors_are_valid_sorted_distinct_and_redrawn():
    T, Bk = 40, 4
    row = torch.zeros(T, dtype=torch.bool)
    row[5:12] = True  # an assistant turn
    row[20] = True  # a one-token turn: nothing supervised follows within Bk
    row[30:40] = True  # the last turn runs to the end
    valid = set(range(5, 11)) | set(range(30, 39))  # needs a supervised label in x[a+1 .. a+Bk]
    loss_mask = torch.stack([row, torch.zeros(T, dtype=torch.bool), row])  # [3, T]: a row with none between
    g = torch.Generator().manual_seed(0)
    seen, draws, same = set(), [], 0
    for _ in range(200):
        anchors, keep = O.draw_anchors(loss_mask, 6, Bk, g)
        assert anchors.shape == (3, 6) and keep[0].all() and keep[2].all() and not keep[1].any()
        assert anchors[1].tolist() == [0] * 6  # padding
        for b in (0, 2):
            a = anchors[b].tolist()
            assert a == sorted(set(a)) and set(a) <= valid
            seen |= set(a)
        same += anchors[0].tolist() == anchors[2].tolist()  # two rows of one mask draw apart
        draws.append(tuple(anchors[0].tolist()))
    assert seen == valid
    assert len(set(draws)) > 100 and same < 10
    everything, keep = O.draw_anchors(loss_mask, 100, Bk, g)  # more asked than valid: every valid one, once
    assert everything.shape == (3, len(valid)) and everything[0].tolist() == sorted(valid) and keep[0].all()
    again = [O.draw_anchors(loss_mask, 6, Bk, torch.Generator().manual_seed(7))[0] for _ in range(2)]
    assert torch.equal(*again)  # a function of the generator's state
    assert O.valid_anchors(row, Bk).tolist() == sorted(valid)  # what a benchmark counts as blocks trained
    assert O.valid_anchor_mask(loss_mask, Bk)[0].nonzero().flatten().tolist() == sorted(valid)


def test_make_blocks_builds_each_row_as_one_sequence_alone():
    """The batched build equals the per-row definition: a sequence's blocks, labels (greedy-prefix
    masked on the target's labels) and attention mask do not depend on the batch it came in."""
    g = torch.Generator().manual_seed(1)
    B, T, Bk, V = 3, 30, 4, 40
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    target = torch.where(torch.rand(B, T, generator=g) < 0.7, ids.roll(-1, dims=1), torch.randint(0, V - 1, (B, T), generator=g))
    labels_ids = O.target_label_ids(ids, target)
    loss_mask = torch.rand(B, T, generator=g) < 0.8
    anchors = [torch.tensor([0, 5, 11, 28]), torch.tensor([3]), torch.tensor([2, 9, 17])]
    batched = O.make_blocks(ids, loss_mask, 0, Bk, M, anchors=anchors, label_ids=labels_ids)
    N = batched.anchors.shape[1]
    for b in range(B):
        alone = O.make_blocks(ids[b:b + 1], loss_mask[b:b + 1], 0, Bk, M, anchors=[anchors[b]], label_ids=labels_ids[b:b + 1])
        n = anchors[b].numel()
        for field in ("block_ids", "positions", "labels", "label_mask", "gru_ids"):
            assert torch.equal(getattr(batched, field)[b, :n], getattr(alone, field)[0]), field
        assert not batched.label_mask[b, n:].any()
        Q = n * Bk
        own = batched.attention_mask[b, 0, :Q]
        assert torch.equal(own[:, :T + Q], O.block_attention_mask(anchors[b], T, Bk))  # the per-sequence rule
        assert not own[:, T + Q:].any()
    assert N == 4


def test_the_block_build_is_a_fixed_number_of_ops_whatever_the_batch():
    """make_blocks runs batched tensor ops: a step's host work does not grow with the sequences
    (a loop over rows issued some 220 ops a sequence, 7,000 at 32 x 1,024)."""
    from torch.profiler import profile

    def ops(B: int) -> int:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 40, (B, 64), generator=g)
        with profile() as prof:
            O.make_blocks(ids, torch.ones(B, 64, dtype=torch.bool), 8, 4, M, generator=g, label_ids=ids)
        return sum(e.count for e in prof.key_averages())

    assert ops(16) == ops(2)


def test_block_attention_mask_by_hand():
    mask = O.block_attention_mask(torch.tensor([1, 3]), context_len=4, block_size=2)
    expected = [
        # ctx 0 1 2 3 | blk0 | blk1
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 1, 1],
    ]
    assert mask.int().tolist() == expected


def test_make_blocks_pads_short_sequences_with_unsupervised_blocks():
    ids = torch.arange(24).view(2, 12) + 1
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 2:] = True
    loss_mask[1, 0:3] = True  # the second sequence has two valid anchors (0, 1); padding reuses
    # anchor 0, whose labels are supervised: only block_keep can mask them
    blocks = O.make_blocks(ids, loss_mask, num_anchors=5, block_size=3, mask_token_id=M,
                           generator=torch.Generator().manual_seed(0))
    assert blocks.anchors.shape == (2, 5) and blocks.block_keep[0].all()
    n1 = int(blocks.block_keep[1].sum())
    assert n1 == 2 and blocks.anchors[1].tolist() == [0, 1, 0, 0, 0]
    assert not blocks.label_mask[1, n1:].any()
    assert blocks.attention_mask.shape == (2, 1, 15, 12 + 15)
    for b in range(2):
        for i, a in enumerate(blocks.anchors[b].tolist()):
            assert blocks.labels[b, i, 0] == ids[b, a + 1] and blocks.gru_ids[b, i, 0] == ids[b, a]
            assert blocks.positions[b, i].tolist() == [a, a + 1, a + 2]


def tiny_draft(vocab=48, hidden=16, block_size=4, **overrides):
    torch.manual_seed(0)
    config = DominoDraftConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, rope_theta=10000.0, block_size=block_size, num_target_layers=4,
        emb_dim=8, dflash_config=dict(mask_token_id=vocab - 1, target_layer_ids=[0, 2], gru_hidden_dim=12, emb_dim=8),
        **overrides,
    )
    embed = torch.nn.Embedding(vocab, hidden).requires_grad_(False)
    head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    return DFlashDraftModel(config), embed, head


def _random_batch(vocab=48, hidden=16, T=20, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 1, (2, T), generator=g)
    loss_mask = torch.ones(2, T, dtype=torch.bool)
    loss_mask[1, 14:] = False
    feats = torch.randn(2, T, 2 * hidden, generator=g)
    blocks = O.make_blocks(ids, loss_mask, 4, block_size, vocab - 1, generator=g)
    return feats, blocks


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_matches_the_boolean_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    draft, embed, head = tiny_draft()
    feats, blocks = _random_batch()
    flex = O.flex_block_mask(blocks.anchors, feats.shape[1], blocks.block_size)
    with torch.no_grad():  # flex_attention has no CPU backward
        base, final = O.draft_block_logits(draft, embed, head, feats, blocks)
        base_f, final_f = O.draft_block_logits(draft, embed, head, feats, blocks, mask=flex)
    torch.testing.assert_close(base_f, base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final_f, final, rtol=1e-5, atol=1e-5)


def test_teacher_forced_training_logits_equal_forced_inference_rollout():
    """The training path (all blocks at once, GRU on gold x[a..a+Bk-1]) and the inference path
    (context cache + sequential rollout whose drafts are forced to the gold tokens) must give the
    same logits at every slot: this pins labels, GRU inputs, positions and context together."""
    draft, embed, head = tiny_draft()
    draft, embed, head = draft.double(), embed.double(), head.double()
    feats, blocks = _random_batch()
    feats = feats.double()
    ids = torch.randint(0, 47, (1, 20), generator=torch.Generator().manual_seed(3))
    anchors = [torch.tensor([3, 9, 14])]
    blocks = O.make_blocks(ids, torch.ones(1, 20, dtype=torch.bool), 3, 4, 47, anchors=anchors)
    with torch.no_grad():
        base, final = O.draft_block_logits(draft, embed, head, feats[:1], blocks)
    for i, a in enumerate(anchors[0].tolist()):
        cache = DraftContextCache(len(draft.layers))
        draft.extend_context(feats[:1, :a], cache)
        gold = iter(ids[0, a + 1: a + 5])
        with torch.no_grad():
            z = draft(embed(blocks.block_ids[:, i]), torch.arange(a, a + 4), cache=cache)[0]
            out = draft.rollout(z, head(z), ids[0, a], embed, sampler=lambda logits: next(gold).view(1))
        assert out.tokens.tolist() == ids[0, a + 1: a + 5].tolist()
        torch.testing.assert_close(out.logits, final[0, i], rtol=0, atol=1e-10)
        torch.testing.assert_close(head(z), base[0, i], rtol=0, atol=1e-10)


def test_position_weights_and_weighted_ce():
    w = O.position_weights(4, 2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=g)
    labels = torch.randint(0, 7, (3, 4), generator=g)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1, 2:] = False
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)  # [3, 4]
    expected = sum(w[k] * ce[n, k] for n in range(3) for k in range(4) if mask[n, k]) / sum(
        w[k] for n in range(3) for k in range(4) if mask[n, k])
    torch.testing.assert_close(O.weighted_ce(logits, labels, mask, w), expected)
    changed = logits.clone()
    changed[1, 3] += 5.0  # an unsupervised slot
    torch.testing.assert_close(O.weighted_ce(changed, labels, mask, w), expected)


def test_curriculum_lambda():
    assert O.curriculum_lambda(0, 100, 1.0) == 1.0
    assert O.curriculum_lambda(25, 100, 1.0) == 0.75
    assert O.curriculum_lambda(100, 100, 1.0) == 0.0
    assert O.curriculum_lambda(25, 100, 0.5) == 0.5
    assert O.curriculum_lambda(60, 100, 0.5) == 0.0
    assert O.curriculum_lambda(0, 100, 0.0) == 0.0


def _grad_norms(model, prefix):
    grads = [p.grad for n, p in model.named_parameters() if n.startswith(prefix)]
    return sum(0.0 if g is None else float(g.abs().sum()) for g in grads)


def test_base_loss_sends_no_gradient_into_the_head_and_lambda_mixes():
    draft, embed, head = tiny_draft()
    feats, blocks = _random_batch()
    w = O.position_weights(4, 3.0)
    base, final = O.draft_block_logits(draft, embed, head, feats, blocks)
    loss, loss_base, loss_final = O.domino_loss(base, final, blocks.labels, blocks.label_mask, w, lam=0.3)
    torch.testing.assert_close(loss, 0.7 * loss_final + 0.3 * loss_base)
    assert not torch.allclose(loss_base, loss_final)

    loss_base.backward(retain_graph=True)
    assert _grad_norms(draft, "prefix_gru") == 0.0 and _grad_norms(draft, "embed_proj") == 0.0
    assert _grad_norms(draft, "layers") > 0 and _grad_norms(draft, "fc") > 0
    draft.zero_grad()
    loss_final.backward()
    assert _grad_norms(draft, "prefix_gru") > 0 and _grad_norms(draft, "embed_proj") > 0


def test_head_off_trains_the_backbone_only():
    draft, embed, head = tiny_draft(use_domino_head=False)
    feats, blocks = _random_batch()
    base, final = O.draft_block_logits(draft, embed, head, feats, blocks)
    assert final is None
    loss, loss_base, loss_final = O.domino_loss(base, final, blocks.labels, blocks.label_mask,
                                                O.position_weights(4, 3.0), lam=0.0)
    assert loss is loss_base is loss_final


def _logits_from_correctness(correct, labels, V=5):
    """One-hot logits whose argmax is the label where correct, another token elsewhere."""
    pred = torch.where(correct, labels, (labels + 1) % V)
    return torch.nn.functional.one_hot(pred, V).float()


def test_accuracy_metrics_and_acceptance_length_by_hand():
    labels = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 0], [3, 4, 0, 1]])
    correct = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    mask = torch.ones(4, 4, dtype=torch.bool)
    logits = _logits_from_correctness(correct, labels)
    torch.testing.assert_close(O.accuracy_by_position(logits, labels, mask), torch.tensor([0.75, 0.75, 0.75, 1.0]))
    prefix = O.prefix_accuracy_by_position(logits, labels, mask)
    torch.testing.assert_close(prefix, torch.tensor([0.75, 0.5, 0.25, 0.25]))
    torch.testing.assert_close(O.conditional_accuracy(prefix), torch.tensor([0.75, 2 / 3, 0.5, 1.0]))
    tau = O.acceptance_length(logits, labels, mask)
    assert tau == pytest.approx(1 + 0.75 + 0.5 + 0.25 + 0.25)
    # Treating marginal accuracies as independent gives a different (wrong) number.
    assert O.expected_acceptance_length(O.accuracy_by_position(logits, labels, mask)) != pytest.approx(tau)

    # A block whose slot 1 is unsupervised counts only at slot 0.
    mask[2, 1] = False
    torch.testing.assert_close(O.prefix_accuracy_by_position(logits, labels, mask),
                               torch.tensor([0.75, 1 / 3, 0.0, 0.0]))
