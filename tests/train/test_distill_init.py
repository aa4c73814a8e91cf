"""Distillation loss, teacher-logit alignment, and initialising the draft from target layers.

Run: python -m pytest tests/train/test_distill_init.py -q
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dominospec.errors import UserError
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.train import objective as O
from dominospec.train.init import init_from_target


def test_soft_ce_equals_hard_ce_for_a_one_hot_teacher_and_exceeds_it_otherwise():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    w = O.position_weights(5, 4.0)
    one_hot = torch.full((3, 5, 11), -1e4).scatter(-1, labels[..., None], 0.0)
    assert torch.allclose(O.soft_ce(logits, one_hot, mask, w), O.weighted_ce(logits, labels, mask, w), atol=1e-6)
    # Against a soft teacher the minimum sits at the teacher itself (Gibbs): q = p beats q = one-hot-ish.
    teacher = torch.randn(3, 5, 11, generator=g)
    assert O.soft_ce(teacher, teacher, mask, w) < O.soft_ce(teacher + 3 * one_hot.clamp(min=-3), teacher, mask, w)


def test_teacher_block_logits_take_the_targets_prediction_for_each_label():
    B, T, V, Bk = 2, 12, 7, 4
    ids = torch.randint(0, V - 1, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    blocks = O.make_blocks(ids, mask, 5, Bk, V - 1, torch.Generator().manual_seed(1))
    # A "target" whose logits at position t put all mass on x[t+1]: the teacher must then equal the labels.
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    target_logits = torch.full((B, T, V), -50.0).scatter(-1, nxt[..., None], 50.0)
    teacher = O.teacher_block_logits(target_logits, blocks)
    right = teacher.argmax(-1) == blocks.labels
    assert right[blocks.label_mask].all() and blocks.label_mask.any()


def _tiny(num_layers: int = 1, intermediate: int = 64):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    config = DominoDraftConfig(vocab_size=32, hidden_size=16, intermediate_size=intermediate, num_hidden_layers=num_layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=4, block_size=4,
                               num_target_layers=4, emb_dim=8,
                               dflash_config=dict(mask_token_id=31, target_layer_ids=[0, 1], gru_hidden_dim=8, emb_dim=8))
    return target, DFlashDraftModel(config)


def test_init_from_target_copies_the_layers_after_the_deepest_feature():
    target, draft = _tiny(num_layers=3)
    init_from_target(draft, target, [0, 1])
    for i, source in enumerate([2, 3, 3]):  # deepest feature 1 -> layers 2, 3, then clamped
        assert torch.equal(draft.layers[i].mlp.up_proj.weight, target.model.layers[source].mlp.up_proj.weight)
        assert torch.equal(draft.layers[i].self_attn.q_proj.weight, target.model.layers[source].self_attn.q_proj.weight)
    assert torch.equal(draft.fc.weight[:, 16:], torch.eye(16)) and not draft.fc.weight[:, :16].any()
    assert torch.equal(draft.norm.weight, target.model.norm.weight)


def test_init_from_target_refuses_a_narrower_draft():
    target, draft = _tiny(intermediate=48)
    with pytest.raises(UserError, match="up_proj|gate_proj"):
        init_from_target(draft, target, [0, 1])
