"""`train.labels: target`: blocks supervised by the target's own greedy tokens at every position.

Run: python -m pytest tests/train/test_target_labels.py -q
"""

import dataclasses

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dominospec.config import load_params
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.train import objective as O
from dominospec.train.datamodule import collate
from dominospec.train.module import DraftLitModule


def test_target_label_ids_shift_the_greedy_tokens_by_one():
    ids = torch.tensor([[5, 6, 7, 8]])
    nxt = torch.tensor([[16, 17, 18, 19]])  # the target's token after x[..t]
    assert O.target_label_ids(ids, nxt).tolist() == [[5, 16, 17, 18]]


def test_greedy_prefix_keeps_slot_j_only_after_a_greedy_gold_prefix():
    agree = torch.tensor([[True, True, False, True], [False, True, True, True]])
    assert O.greedy_prefix(agree).tolist() == [[True, True, True, False], [True, False, False, False]]


def test_blocks_with_target_labels_take_the_greedy_token_and_mask_off_path_slots():
    B, T, V, Bk = 2, 20, 9, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (B, T), generator=g)
    nxt = torch.randint(0, V - 1, (B, T), generator=g)
    nxt[:, ::3] = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)[:, ::3]  # the gold token is greedy at every third
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 0] = False
    label_ids = O.target_label_ids(ids, nxt)
    blocks = O.make_blocks(ids, mask, 6, Bk, V - 1, torch.Generator().manual_seed(1), label_ids=label_ids)
    checked = 0
    for b in range(B):
        for n, a in enumerate(blocks.anchors[b].tolist()):
            for j in range(Bk):
                pos = a + 1 + j
                greedy = all(int(ids[b, a + 1 + i]) == int(nxt[b, a + i]) for i in range(j))
                expected = pos < T and greedy
                assert bool(blocks.label_mask[b, n, j]) == expected, (b, a, j)
                if expected:
                    assert int(blocks.labels[b, n, j]) == int(nxt[b, a + j])
                    checked += 1
    assert checked > B * 6  # slot 0 of every block, plus greedy continuations
    # Without label_ids nothing changes: gold labels on loss-masked positions.
    plain = O.make_blocks(ids, mask, 6, Bk, V - 1, torch.Generator().manual_seed(1))
    assert torch.equal(plain.labels[..., 0], ids.gather(1, plain.anchors + 1))


def _module(labels: str):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    config = DominoDraftConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=4, block_size=4,
                               num_target_layers=3, emb_dim=8,
                               dflash_config=dict(mask_token_id=31, target_layer_ids=[0, 1], gru_hidden_dim=8, emb_dim=8))
    hp = dataclasses.replace(load_params("params.yaml").train, labels=labels, features="online", num_anchors=8,
                             precision="32-true")
    module = DraftLitModule(DFlashDraftModel(config), target.model.embed_tokens.weight, target.lm_head.weight, hp,
                            online_target=target, layer_ids=[0, 1])
    return target, module


def test_online_target_labels_are_the_targets_argmax_and_cover_user_turns():
    target, module = _module("target")
    g = torch.Generator().manual_seed(3)
    items = [{"input_ids": torch.randint(0, 30, (n,), generator=g), "loss_mask": torch.zeros(n, dtype=torch.bool)}
             for n in (14, 10)]  # no assistant token at all: data labels would train nothing
    batch = collate(items)
    logits = target(input_ids=batch["input_ids"], attention_mask=module._attention_mask(batch)).logits
    nxt = logits.argmax(-1)
    feats, online = module.features_and_next(batch)  # the online step's labels: no [B, T, V] logits held
    real = module._attention_mask(batch).bool()
    assert torch.equal(online[real], nxt[real])
    torch.testing.assert_close(feats, module.features(batch))
    blocks = module._train_blocks(batch, online)
    assert blocks.label_mask.any()
    for b in range(2):
        n = int(batch["lengths"][b])
        for k, a in enumerate(blocks.anchors[b][blocks.block_keep[b]].tolist()):
            assert 1 <= a < n - 1
            assert int(blocks.labels[b, k, 0]) == int(nxt[b, a])  # slot 0: the target's token after x[..a]
            assert not blocks.label_mask[b, k, (n - 1 - a):].any()  # nothing past the sequence's end
    # A cached target_next [B, T] is used as is, with no target forward.
    cached = dict(batch, target_next=nxt)
    assert torch.equal(module._train_blocks(cached, None).labels, blocks.labels)
    # Data labels on the same batch supervise nothing (no assistant tokens).
    _, data_module = _module("data")
    assert not data_module._train_blocks(batch, None).label_mask.any()
