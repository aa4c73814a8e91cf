"""End-to-end learning check on CPU: a tiny draft overfits one batch of a tiny random Llama target.

The data follow x[t+1] = f(x[t]) for a fixed permutation f without fixed points, so the block after
an anchor is fully determined. Trained on the right labels the draft reaches an expected acceptance
length near Bk + 1; trained on labels shifted by one slot (slot j -> x[a+j], the silent
mis-alignment) it is scored near 1 against the right labels: the metric exposes the shift.
Run: python -m pytest tests/train/test_overfit.py -q
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.train import objective as O

V, H, BK, LAYER_IDS, MASK = 64, 32, 4, [0, 1], 63


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def chain_batch(B=2, T=40, seed=0):
    """Token ids [B, T] with x[t+1] = f(x[t]) (f: one cycle over 0..V-2, MASK never occurs),
    loss mask [B, T] off on a 4-token prompt."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(V - 1, generator=g)
    f = torch.empty(V - 1, dtype=torch.long)
    f[order] = order.roll(-1)  # order[i] -> order[i+1]: a single cycle, no fixed point
    ids = torch.empty(B, T, dtype=torch.long)
    ids[:, 0] = torch.randint(0, V - 1, (B,), generator=g)
    for t in range(1, T):
        ids[:, t] = f[ids[:, t - 1]]
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[:, :4] = False
    return ids, loss_mask


def train_draft(target, ids, blocks, features, labels, steps=120):
    """Plain AdamW on one fixed batch, base-anchored curriculum over the first half."""
    torch.manual_seed(0)
    config = DominoDraftConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=10000.0, block_size=BK, num_target_layers=2, emb_dim=16,
        dflash_config=dict(mask_token_id=MASK, target_layer_ids=LAYER_IDS, gru_hidden_dim=32, emb_dim=16),
    )
    draft = DFlashDraftModel(config).train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.0)
    weights = O.position_weights(BK, 4.0)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    for step in range(steps):
        base, final = O.draft_block_logits(draft, embed, head, features, blocks)
        lam = O.curriculum_lambda(step, steps, 0.5)
        loss, _, _ = O.domino_loss(base, final, labels, blocks.label_mask, weights, lam)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    draft.eval()
    with torch.no_grad():
        return draft, O.draft_block_logits(draft, embed, head, features, blocks)


def test_tiny_draft_overfits_and_the_metric_exposes_a_one_slot_shift():
    target = tiny_target()
    ids, loss_mask = chain_batch()
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[l + 1] for l in LAYER_IDS], dim=-1)  # [B, T, n*H]
    blocks = O.make_blocks(ids, loss_mask, num_anchors=8, block_size=BK, mask_token_id=MASK,
                           generator=torch.Generator().manual_seed(1))
    assert blocks.label_mask[:, :, 0].all()

    _, (base, final) = train_draft(target, ids, blocks, features, blocks.labels)
    tau = O.acceptance_length(final, blocks.labels, blocks.label_mask)
    assert tau >= 0.9 * BK + 1, tau
    assert O.accuracy_by_position(final, blocks.labels, blocks.label_mask).min() > 0.9

    # The same training with every label one slot early (slot j -> x[a+j]).
    shifted = blocks.gru_ids
    _, (base_s, final_s) = train_draft(target, ids, blocks, features, shifted)
    assert O.acceptance_length(final_s, shifted, blocks.label_mask) >= 0.9 * BK + 1  # it learned *something*
    assert O.acceptance_length(final_s, blocks.labels, blocks.label_mask) < 1.2  # ...but not the next tokens
