"""`train.loss_vocab: data`: the training softmax over the tokens the train split supervises.

Run: python -m pytest tests/train/test_loss_vocab.py -q
"""

import torch

from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.train import objective as O

V, H = 32, 16


def _draft() -> DFlashDraftModel:
    torch.manual_seed(0)
    config = DominoDraftConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=4, block_size=4,
                               num_target_layers=4, emb_dim=8,
                               dflash_config=dict(mask_token_id=31, target_layer_ids=[0, 1], gru_hidden_dim=8, emb_dim=8))
    return DFlashDraftModel(config).eval()


def test_loss_vocabulary_is_exactly_the_supervised_tokens():
    items = [
        {"input_ids": torch.tensor([5, 9, 9, 2, 7]), "loss_mask": torch.tensor([0, 0, 1, 1, 0], dtype=torch.bool)},
        {"input_ids": torch.tensor([1, 30, 4]), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.bool)},
    ]
    vocab = O.loss_vocabulary(items)
    assert vocab.tolist() == [2, 4, 9, 30]  # 5, 7 and 1 are never supervised
    index = O.vocab_index(vocab, V)
    assert index[vocab].tolist() == [0, 1, 2, 3]
    assert (index >= 0).sum() == 4 and index[5] == -1


def test_logits_over_the_loss_vocabulary_are_the_full_logits_columns():
    """Restricting the LM head and W2 to V' columns must give exactly the full logits' columns,
    head on (base and final), so the restricted softmax is the full one conditioned on V'."""
    draft = _draft()
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    ids = torch.randint(0, V - 1, (2, 20), generator=g)
    blocks = O.make_blocks(ids, torch.ones(2, 20, dtype=torch.bool), 3, 4, 31, torch.Generator().manual_seed(2))
    feats = torch.randn(2, 20, 2 * H, generator=g)
    vocab = torch.tensor([0, 3, 4, 11, 17, 30])
    emb = lambda t: torch.nn.functional.embedding(t, embed)  # noqa: E731
    with torch.no_grad():
        base, final = O.draft_block_logits(draft, emb, lambda z: z @ lm_head.t(), feats, blocks)
        sub_base, sub_final = O.draft_block_logits(draft, emb, lambda z: z @ lm_head[vocab].t(), feats, blocks,
                                                   vocab_ids=vocab)
    assert sub_base.shape[-1] == vocab.numel()
    torch.testing.assert_close(sub_base, base[..., vocab], rtol=0, atol=1e-5)
    torch.testing.assert_close(sub_final, final[..., vocab], rtol=0, atol=1e-5)
    # ... and the correction really is in them (the head is not a no-op on these columns)
    assert (sub_final - sub_base).abs().max() > 1e-3
