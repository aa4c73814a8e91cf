"""The Domino training objective, pure torch: anchors -> blocks -> masks -> logits -> losses -> metrics.

Layout (shift_label = true). For an anchor a of a sequence x[0..T-1], block slot j (0 <= j < Bk):
    block input   x[a] at j = 0, MASK elsewhere            (target-embedded)
    position      a + j
    label         x[a+1+j]      supervised iff a+1+j < T and loss_mask[a+1+j]
    GRU input     x[a+j]        (teacher forcing: state j has consumed x[a..a+j])
    context       target features at positions < a (strictly: the anchor's own is not visible)

Losses: position weights w_k = exp(-k/gamma); L_base and L_final are sum(w * CE) / sum(w) over
supervised slots; L = (1 - lam) * L_final + lam * L_base with lam linear 1 -> 0 (the base-anchored
curriculum). Base logits come from z only, so L_base never reaches the head.

Metrics: accuracy by position (marginal), prefix accuracy by position (all slots <= k right,
per block, then mean) and the expected acceptance length 1 + sum_k prefix_k, which is exact for
greedy drafting because the teacher-forced prefix equals the drafted one whenever it is right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from dominospec.train.chunked_ce import chunked_cross_entropy

# ----------------------------------------------------------------------------------------------
# Anchors: where blocks start
# ----------------------------------------------------------------------------------------------


def valid_anchors(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """loss_mask [T] bool -> the positions a block may start at [n] (draw_anchors' rule), on the CPU."""
    return valid_anchor_mask(loss_mask.cpu()[None], block_size)[0].nonzero().flatten()


def valid_anchor_mask(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """loss_mask [B, T] bool -> [B, T] bool, True where a block may start (draw_anchors' rule): on
    loss_mask's device, no host read."""
    T = loss_mask.shape[1]
    mask = loss_mask.bool()
    # supervised[a] = any(loss_mask[a+1 : a+1+block_size]); padded so windows past T see False.
    ahead = F.pad(mask[:, 1:].float(), (0, block_size))  # [B, T - 1 + Bk]
    supervised = ahead.unfold(1, block_size, 1)[:, :T].amax(dim=-1) > 0  # [B, T]
    return mask & supervised  # implies a + 1 < T


def draw_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int,
                 generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, T] -> (anchors [B, N], keep [B, N]): each row's min(num_anchors, #valid) anchors
    drawn uniformly without replacement (the valid positions with the smallest random keys), sorted,
    first in the row; padding anchors are 0 with keep False. N = the most any row drew (>= 1): one
    host read a batch. The keys come from `generator` on the CPU, so the draw is the same on any device."""
    B, T = loss_mask.shape
    valid = valid_anchor_mask(loss_mask, block_size)  # [B, T]
    N = max(1, min(num_anchors, int(valid.sum(dim=1).max())))
    keys = torch.rand(B, T, generator=generator).to(valid.device).masked_fill(~valid, 2.0)  # invalid last
    picked_keys, picked = keys.topk(N, dim=1, largest=False)  # [B, N]
    drawn = picked_keys < 2.0
    anchors = picked.masked_fill(~drawn, T).sort(dim=1).values  # drawn ones first, ascending
    keep = torch.arange(N, device=valid.device)[None] < drawn.sum(dim=1, keepdim=True)
    return anchors.masked_fill(~keep, 0), keep


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """anchors [N], context length S -> bool [Q, S+Q], Q = N*Bk, True = may attend.
    Block b sees context rows kv < anchors[b] and all Bk slots of itself, nothing of other blocks."""
    N = anchors.numel()
    block_of = torch.arange(N * block_size, device=anchors.device) // block_size  # [Q]
    ctx = torch.arange(context_len, device=anchors.device)[None] < anchors[block_of][:, None]  # [Q, S]
    own = block_of[:, None] == block_of[None]  # [Q, Q]
    return torch.cat([ctx, own], dim=1)


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int):
    """anchors [B, N] (padded), context length S -> flex_attention BlockMask over [Q, S+Q] with
    the same visibility as `block_attention_mask`, for every sequence b."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = anchors.shape
    Q = N * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        in_ctx = kv_idx < context_len
        sees_ctx = in_ctx & (kv_idx < anchors[b, block])
        sees_own = (~in_ctx) & ((kv_idx - context_len) // block_size == block)
        return sees_ctx | sees_own

    return create_block_mask(mask_mod, B, None, Q, context_len + Q, device=anchors.device)


# ----------------------------------------------------------------------------------------------
# A padded batch of blocks
# ----------------------------------------------------------------------------------------------


@dataclass
class BlockBatch:
    """Blocks of B sequences, N = max anchors per sequence (short sequences padded, block_keep False).

    anchors [B, N], block_keep [B, N], block_ids / positions / labels / label_mask / gru_ids
    [B, N, Bk], attention_mask [B, 1, N*Bk, T+N*Bk] bool.
    """

    anchors: torch.Tensor
    block_keep: torch.Tensor
    block_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    gru_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[-1]


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    generator: Optional[torch.Generator] = None,
    anchors: Optional[list[torch.Tensor]] = None,
    label_ids: Optional[torch.Tensor] = None,
) -> BlockBatch:
    """input_ids [B, T], loss_mask [B, T] (False on padding) -> BlockBatch, anchors re-drawn
    (or the given per-sequence `anchors`, for evaluation and tests).

    `label_ids` [B, T] (default: input_ids) is the token each position should hold; slot j's label
    is label_ids[a+1+j]. With the target's own labels (`target_label_ids`) a slot j >= 1 is
    supervised only where the block's gold tokens x[a+1..a+j] are the target's greedy path: the
    engine drafts slot j only after slots < j were accepted, i.e. after a greedy prefix."""
    B, T = input_ids.shape
    device = input_ids.device
    greedy = label_ids is not None
    label_ids = input_ids if label_ids is None else label_ids
    if anchors is None:
        padded, keep = draw_anchors(loss_mask, num_anchors, block_size, generator)
    else:
        N = max(1, max(a.numel() for a in anchors))
        padded = torch.zeros(B, N, dtype=torch.long, device=device)
        keep = torch.zeros(B, N, dtype=torch.bool, device=device)
        for b, a in enumerate(anchors):
            padded[b, : a.numel()] = a.to(device)
            keep[b, : a.numel()] = True
    N = padded.shape[1]
    positions = padded[..., None] + torch.arange(block_size, device=device)  # [B, N, Bk]: a + j

    def at(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:  # values [B, T], where [B, N, Bk]
        return values.gather(1, where.clamp(max=T - 1).view(B, -1)).view(B, N, block_size)

    labels = at(label_ids, positions + 1)  # x[a+1+j] (clamped; masked below where out of bounds)
    label_mask = (positions + 1 < T) & at(loss_mask.bool(), positions + 1) & keep[..., None]
    if greedy:  # slot j trains only after a greedy prefix: the gold tokens of slots < j are the target's
        label_mask = label_mask & greedy_prefix(at(input_ids, positions + 1) == labels)
    block_ids = torch.full((B, N, block_size), mask_token_id, dtype=input_ids.dtype, device=device)
    block_ids[..., 0] = input_ids.gather(1, padded)
    # attention [B, 1, Q, T+Q], Q = N*Bk: query q of block q // Bk sees context kv < its anchor and its own block
    block_of = torch.arange(N * block_size, device=device) // block_size  # [Q]
    sees_context = torch.arange(T, device=device)[None, None] < padded[:, block_of, None]  # [B, Q, T]
    sees_own = (block_of[:, None] == block_of[None]).expand(B, -1, -1)  # [B, Q, Q]
    return BlockBatch(
        anchors=padded,
        block_keep=keep,
        block_ids=block_ids,
        positions=positions,
        labels=labels,
        label_mask=label_mask,
        gru_ids=at(input_ids, positions),  # x[a+j], teacher forcing (clamped: feeds only masked slots)
        attention_mask=torch.cat([sees_context, sees_own], dim=-1)[:, None],
    )


def target_label_ids(input_ids: torch.Tensor, target_next: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T], target_next [B, T] (the target's greedy token after x[..t]) -> label ids
    [B, T]: position t should hold target_next[t-1] (position 0 keeps its own token)."""
    return torch.cat([input_ids[:, :1], target_next[:, :-1].to(input_ids.dtype)], dim=1)


def greedy_prefix(agree: torch.Tensor) -> torch.Tensor:
    """agree [..., Bk] (slot j's gold token is the target's greedy one) -> ok [..., Bk]: slot j's
    prefix x[a+1..a+j] (the gold tokens of slots < j) is greedy throughout; slot 0 always ok."""
    ok = agree.long().cumprod(dim=-1).bool()
    return torch.cat([torch.ones_like(ok[..., :1]), ok[..., :-1]], dim=-1)


def draft_block_logits(draft, embed_tokens, lm_head, target_features: torch.Tensor, blocks: BlockBatch, mask=None,
                       vocab_ids: Optional[torch.Tensor] = None):
    """One training forward: target_features [B, T, n*H] + BlockBatch -> (base, final) logits
    [B, N, Bk, V]; final is None when the draft's head is off. `mask` overrides the boolean
    attention mask (e.g. a flex BlockMask from `flex_block_mask`). Computes each [.., V] once.
    With a loss vocabulary, `lm_head` maps to its V' columns and `vocab_ids` [V'] names them."""
    B, N, Bk = blocks.block_ids.shape
    block_embeds = embed_tokens(blocks.block_ids.view(B, N * Bk))  # [B, Q, H]
    z = draft(
        block_embeds,
        blocks.positions.view(B, N * Bk),
        target_features=target_features,
        attention_mask=blocks.attention_mask if mask is None else mask,
    )  # [B, Q, H]
    z = z.view(B * N, Bk, -1)
    base = lm_head(z)  # [B*N, Bk, V]
    if not draft.config.use_domino_head:
        return base.view(B, N, Bk, -1), None
    states = draft.gru_states(embed_tokens(blocks.gru_ids.view(B * N, Bk)))  # [B*N, Bk, G]
    final = draft.final_logits(base, z, states, vocab_ids)
    return base.view(B, N, Bk, -1), final.view(B, N, Bk, -1)


# ----------------------------------------------------------------------------------------------
# The loss vocabulary (train.loss_vocab: data)
# ----------------------------------------------------------------------------------------------


def loss_vocabulary(sequences) -> torch.Tensor:
    """Iterable of {"input_ids" [T], "loss_mask" [T]} -> sorted ids [V'] of every supervised token:
    every label a block of these sequences can carry (block labels sit on loss-masked positions)."""
    seen: set[int] = set()
    for item in sequences:
        seen.update(item["input_ids"][item["loss_mask"].bool()].tolist())
    return torch.tensor(sorted(seen), dtype=torch.long)


def vocab_index(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [V'] -> index [V]: index[vocab_ids[i]] = i, -1 for tokens outside the loss vocabulary."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[vocab_ids.cpu()] = torch.arange(vocab_ids.numel())
    return index


# ----------------------------------------------------------------------------------------------
# Losses and the curriculum
# ----------------------------------------------------------------------------------------------


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """-> w [Bk], w_k = exp(-k / gamma): early slots matter most (a miss ends acceptance)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / gamma)


RowCE = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits [N, V], labels [N] -> CE [N] fp32


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, weights: torch.Tensor,
                ce: RowCE = chunked_cross_entropy) -> torch.Tensor:
    """logits [..., Bk, V], labels / label_mask [..., Bk], w [Bk] -> scalar sum(w*CE) / sum(w)
    over supervised slots (0, still attached to the graph, when nothing is supervised). `ce` is the
    per-row cross-entropy (= F.cross_entropy in fp32): chunked torch ops, or the fused kernel."""
    V = logits.shape[-1]
    rows = ce(logits.reshape(-1, V), labels.reshape(-1)).view(labels.shape)  # [..., Bk]
    w = weights.to(rows.device) * label_mask.float()  # [..., Bk]
    return (w * rows).sum() / w.sum().clamp(min=1e-12)


def soft_ce(
    logits: torch.Tensor, teacher_logits: torch.Tensor, label_mask: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Distillation: logits / teacher_logits [..., Bk, V] (the target's next-token logits at the
    same label position), label_mask [..., Bk], w [Bk] -> scalar sum(w * H(p_t, q)) / sum(w),
    the cross-entropy of the draft q against the target's distribution p_t (KL up to a constant)."""
    V = logits.shape[-1]
    p = torch.softmax(teacher_logits.reshape(-1, V).float(), dim=-1)
    ce = -(p * torch.log_softmax(logits.reshape(-1, V).float(), dim=-1)).sum(-1).view(label_mask.shape)
    w = weights.to(ce.device) * label_mask.float()
    return (w * ce).sum() / w.sum().clamp(min=1e-12)


def teacher_block_logits(target_logits: torch.Tensor, blocks: "BlockBatch") -> torch.Tensor:
    """target_logits [B, T, V] -> [B, N, Bk, V]: for slot j of anchor a, the target's logits at
    position a+j, i.e. its distribution over the slot's label x[a+1+j] (clamped in bounds; those
    slots are masked)."""
    B, T, V = target_logits.shape
    _, N, Bk = blocks.positions.shape
    pos = blocks.positions.clamp(max=T - 1).view(B, N * Bk, 1).expand(B, N * Bk, V)
    return target_logits.gather(1, pos).view(B, N, Bk, V)


def curriculum_lambda(step: int, total_steps: int, decay_fraction: float) -> float:
    """Optimizer step -> lam, linear from 1 at step 0 to 0 at decay_fraction * total_steps, then 0.
    decay_fraction = 0 disables the curriculum (lam = 0 throughout)."""
    decay_steps = decay_fraction * total_steps
    if decay_steps <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - step / decay_steps))


def domino_loss(
    base_logits: torch.Tensor,
    final_logits: Optional[torch.Tensor],
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    weights: torch.Tensor,
    lam: float,
    teacher_logits: Optional[torch.Tensor] = None,
    ce: RowCE = chunked_cross_entropy,
    distill: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (L, L_base, L_final) with L = (1 - lam) * L_final + lam * L_base. Without a head
    (final_logits None) L = L_base = L_final. L_base depends on z only: no gradient into the head.
    With `teacher_logits` [..., Bk, V] both terms distil the target's distribution (`soft_ce`)
    instead of the hard labels; `distill` (logits [..., Bk, V] -> scalar, e.g. train/distill.py's
    `weighted_distill`) replaces the term outright."""
    if distill is not None:
        term = distill
    elif teacher_logits is None:
        term = lambda logits: weighted_ce(logits, labels, label_mask, weights, ce)  # noqa: E731
    else:
        term = lambda logits: soft_ce(logits, teacher_logits, label_mask, weights)  # noqa: E731
    loss_base = term(base_logits)
    if final_logits is None:
        return loss_base, loss_base, loss_base
    loss_final = term(final_logits)
    return (1.0 - lam) * loss_final + lam * loss_base, loss_base, loss_final


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def _flat(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor):
    """[..., Bk, V], [..., Bk] -> correct [M, Bk] bool, label_mask [M, Bk] bool."""
    Bk = labels.shape[-1]
    correct = logits.argmax(dim=-1).reshape(-1, Bk) == labels.reshape(-1, Bk)
    return correct, label_mask.reshape(-1, Bk).bool()


@torch.no_grad()
def accuracy_by_position(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """logits [..., Bk, V], labels / label_mask [..., Bk] -> marginal top-1 accuracy [Bk] over
    supervised slots (0 where a slot is never supervised)."""
    correct, mask = _flat(logits, labels, label_mask)
    return (correct & mask).sum(0).float() / mask.sum(0).clamp(min=1).float()


@torch.no_grad()
def prefix_accuracy_by_position(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """-> [Bk], entry k = fraction of blocks whose slots 0..k are all right, over the blocks whose
    slots 0..k are all supervised (0 where there are none). This is P(acceptance > k)."""
    correct, mask = _flat(logits, labels, label_mask)
    counted = mask.long().cumprod(dim=1).bool()  # [M, Bk]
    all_right = correct.long().cumprod(dim=1).bool() & counted
    return all_right.sum(0).float() / counted.sum(0).clamp(min=1).float()


def conditional_accuracy(prefix_accuracy: torch.Tensor) -> torch.Tensor:
    """Prefix accuracy p [Bk] -> c [Bk], c_k = P(slot k right | slots < k right) = p_k / p_{k-1}."""
    previous = torch.cat([prefix_accuracy.new_ones(1), prefix_accuracy[:-1]])
    return torch.where(previous > 0, prefix_accuracy / previous.clamp(min=1e-12), torch.zeros_like(previous))


def expected_acceptance_length(conditional_acc: torch.Tensor) -> float:
    """Conditional accuracies c [Bk] -> tau = 1 + sum_k prod_{i<=k} c_i (bonus token included).
    Feed `conditional_accuracy(prefix_accuracy_by_position(...))`; marginal accuracies would
    assume independent slots and misstate tau."""
    return 1.0 + float(torch.cumprod(conditional_acc.double(), dim=0).sum())


def acceptance_length(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> float:
    """Teacher-forced logits [..., Bk, V] -> expected acceptance length tau in [1, Bk + 1]."""
    return expected_acceptance_length(conditional_accuracy(prefix_accuracy_by_position(logits, labels, label_mask)))


__all__ = [
    "BlockBatch",
    "valid_anchors",
    "valid_anchor_mask",
    "draw_anchors",
    "block_attention_mask",
    "flex_block_mask",
    "make_blocks",
    "target_label_ids",
    "greedy_prefix",
    "draft_block_logits",
    "position_weights",
    "weighted_ce",
    "soft_ce",
    "teacher_block_logits",
    "curriculum_lambda",
    "domino_loss",
    "accuracy_by_position",
    "prefix_accuracy_by_position",
    "conditional_accuracy",
    "expected_acceptance_length",
    "acceptance_length",
]
