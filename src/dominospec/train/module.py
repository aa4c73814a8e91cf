"""`DraftLitModule`: the LightningModule around the plain draft model.

It owns the loss (base-anchored curriculum), the optimiser and the logging; the draft itself
(`dominospec.models.domino.DFlashDraftModel`) knows nothing of Lightning and is what gets exported.
The target's embedding table and LM head are frozen, non-persistent buffers: used, never trained,
never saved in checkpoints. In `online` feature mode the frozen target also computes the
features inside the step.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn.functional as F

from dominospec.config import TrainParams
from dominospec.models.domino import DFlashDraftModel
from dominospec.train.chunked_ce import row_cross_entropy
from dominospec.train.sampled_vocab import sample_vocabulary
from dominospec.train.walk import WalkStats, walk_sequence
from dominospec.train.objective import (
    curriculum_lambda,
    domino_loss,
    draft_block_logits,
    make_blocks,
    position_weights,
    target_label_ids,
    vocab_index,
)
from dominospec.train.distill import block_teacher_index, distill_kernel, weighted_distill


class BlockAccuracy:
    """Accumulates, per block position k, how many blocks had slots 0..k all right (and counted)."""

    def __init__(self, block_size: int):
        self.right = torch.zeros(block_size, dtype=torch.float64)
        self.counted = torch.zeros(block_size, dtype=torch.float64)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> None:
        """logits [..., Bk, V], labels / label_mask [..., Bk]."""
        Bk = labels.shape[-1]
        correct = (logits.argmax(-1) == labels).reshape(-1, Bk).long().cpu()
        mask = label_mask.reshape(-1, Bk).long().cpu()
        counted = mask.cumprod(1)
        self.right += (correct.cumprod(1) * counted).sum(0).double()
        self.counted += counted.sum(0).double()

    def prefix_accuracy(self) -> list[float]:
        """[Bk]: P(slots 0..k all accepted), k = 0..Bk-1."""
        return (self.right / self.counted.clamp(min=1)).tolist()

    def acceptance_length(self) -> float:
        """Expected tokens per verify round, bonus included: 1 + sum_k P(slots 0..k accepted)."""
        return 1.0 + float(sum(self.prefix_accuracy()))


class DraftLitModule(L.LightningModule):
    """Trains `draft` on blocks drawn from (token ids, loss mask, target features) batches."""

    def __init__(
        self,
        draft: DFlashDraftModel,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        train: TrainParams,
        online_target: Optional[torch.nn.Module] = None,
        layer_ids: Optional[list[int]] = None,
        loss_vocab: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.draft = draft
        self.hp = train
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)  # [V, H]
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)  # [V, H]
        # train.loss_vocab: data -> the training softmax spans V' supervised tokens (validation
        # stays on the full vocabulary): their ids [V'], their LM-head rows [V', H], and the
        # map [V] from a token id to its column (-1 outside).
        self.register_buffer("loss_vocab_ids", None if loss_vocab is None else loss_vocab, persistent=False)
        self.register_buffer("loss_lm_head_weight", None if loss_vocab is None else lm_head_weight.detach()[loss_vocab],
                             persistent=False)
        self.register_buffer("loss_vocab_index", None if loss_vocab is None else vocab_index(loss_vocab, lm_head_weight.shape[0]),
                             persistent=False)
        self.register_buffer("slot_weights", position_weights(draft.config.block_size, train.loss_gamma), persistent=False)
        # The online target is frozen and not part of this module's state (not saved, not trained).
        self.__dict__["online_target"] = online_target
        self.layer_ids = layer_ids
        self.val_head = BlockAccuracy(draft.config.block_size)
        self.val_base = BlockAccuracy(draft.config.block_size)
        self.val_loss_sum, self.val_batches = 0.0, 0
        self.walks = empty_walks()
        self.last_summary: dict[str, Any] = {}
        self._row_ce: Any = None  # train.ce_kernel, resolved on the device of the first step
        self._distill_kernel: Optional[str] = None  # train.distill_kernel, likewise
        # train.max_minutes: the fraction of the time budget spent, the same on every rank (timed.TimeBudget
        # sets it); None = the schedule runs on steps alone
        self.budget_spent: Optional[Callable[[], float]] = None

    # ---- frozen target parts -------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> target embeddings [..., H] (frozen)."""
        return F.embedding(ids, self.embed_weight)

    def lm_head(self, z: torch.Tensor) -> torch.Tensor:
        """Draft states [..., H] -> base logits [..., V] through the target's frozen LM head."""
        return F.linear(z, self.lm_head_weight.to(z.dtype))

    def loss_lm_head(self, z: torch.Tensor) -> torch.Tensor:
        """Draft states [..., H] -> base logits over the loss vocabulary [..., V']."""
        return F.linear(z, self.loss_lm_head_weight.to(z.dtype))

    def features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Batch -> target features [B, T, n*H]: from the cache, or computed now (online mode)."""
        if "target_hidden" in batch:
            return batch["target_hidden"]
        from dominospec.cache.features import target_hidden

        return target_hidden(self._target(), batch["input_ids"], self._attention_mask(batch), self.layer_ids).clone()

    def features_and_next(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch -> (target features [B, T, n*H], the target's greedy next token [B, T]): one whole
        target forward whose LM head runs on row chunks, so no [B, T, V] logits are held (online
        `train.labels: target` with hard labels)."""
        from dominospec.cache.features import target_hidden_and_next

        feats, nxt = target_hidden_and_next(self._target(), batch["input_ids"], self._attention_mask(batch),
                                            self.layer_ids, chunk_rows=4096)
        return feats.clone(), nxt.clone()

    def features_and_teacher(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch -> (target features [B, T, n*H], target logits [B, T, V]): one whole target
        forward, for `train.loss: kd` (distillation needs the whole distribution)."""
        from dominospec.cache.features import target_hidden_and_logits

        feats, logits = target_hidden_and_logits(self._target(), batch["input_ids"], self._attention_mask(batch),
                                                 self.layer_ids)
        return feats.clone(), logits.clone()

    def _target(self) -> torch.nn.Module:
        target = self.online_target
        if target.device != self.device:
            target.to(self.device)
        return target

    def _attention_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        T = batch["input_ids"].shape[1]
        return (torch.arange(T, device=self.device)[None] < batch["lengths"][:, None].to(self.device)).long()

    # ---- steps ---------------------------------------------------------------------------------

    def _blocks(self, batch: dict[str, torch.Tensor], generator: torch.Generator):
        cfg = self.draft.config
        return make_blocks(
            batch["input_ids"], batch["loss_mask"], self.hp.num_anchors, cfg.block_size, cfg.mask_token_id, generator
        )

    def _generator(self, salt: int) -> torch.Generator:
        """Anchors are a function of (seed, step, rank): a resumed run draws what it would have drawn."""
        return torch.Generator().manual_seed(self.hp.seed * 1_000_003 + salt * 7919 + self.global_rank)

    def schedule_step(self, step: int) -> float:
        """Optimiser step -> where the schedules (LR, lambda) stand, in steps of max_steps: the step itself,
        or with a time budget the larger of it and the budget's spent fraction of max_steps, so a run the
        clock stops ends with its LR and curriculum run down as a run of max_steps does."""
        if self.budget_spent is None:
            return step
        return max(float(step), self.budget_spent() * self.trainer.max_steps)

    def curriculum(self) -> float:
        """lambda at the current optimiser step (1 -> 0 over lambda_decay_fraction of max_steps)."""
        return curriculum_lambda(self.schedule_step(self.global_step), self.trainer.max_steps, self.hp.lambda_decay_fraction)

    def row_ce(self):
        """The per-row cross-entropy of the loss (train.ce_kernel on this module's device)."""
        if self._row_ce is None:
            self._row_ce = row_cross_entropy(self.hp.ce_kernel, self.device)
        return self._row_ce

    def distill_term(self, target_logits: torch.Tensor, blocks, label_mask: torch.Tensor,
                     columns: Optional[torch.Tensor] = None):
        """The target's logits [B, T, V], this step's blocks, label_mask [B, N, Bk], the loss vocabulary's
        ids [V'] (None: all) -> the loss term on the target's distribution (train.loss kd = mix 0, or
        tv), logits [B, N, Bk, V'] -> scalar; each slot reads the target's row a + j (train/distill.py),
        by train.distill_kernel on this module's device."""
        if self._distill_kernel is None:
            self._distill_kernel = distill_kernel(self.hp.distill_kernel, self.device)
        index = block_teacher_index(blocks.positions, target_logits.shape[1])
        mix = 0.0 if self.hp.loss == "kd" else self.hp.tv_mix
        return partial(weighted_distill, target_logits=target_logits, index=index, label_mask=label_mask,
                       weights=self.slot_weights, temperature=self.hp.tv_temperature, mix=mix, columns=columns,
                       kernel=self._distill_kernel)

    def _train_blocks(self, batch: dict[str, torch.Tensor], target_next: Optional[torch.Tensor]):
        """This step's blocks. train.labels: data -> labels are the data's tokens on loss-masked
        positions; target -> every real position after the first is supervised by the target's
        own greedy token (`target_next` [B, T]: cached, or from the online forward)."""
        generator = self._generator(self.global_step)
        if self.hp.labels == "data":
            return self._blocks(batch, generator)
        target_next = batch.get("target_next", target_next)
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        supervised = (positions >= 1) & (positions < batch["lengths"].to(ids.device)[:, None])  # [B, T]
        cfg = self.draft.config
        return make_blocks(ids, supervised, self.hp.num_anchors, cfg.block_size, cfg.mask_token_id, generator,
                           label_ids=target_label_ids(ids, target_next.to(ids.device)))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        target_logits = target_next = None
        if self.hp.loss in ("kd", "tv"):  # the whole distribution: one target forward, its logits [B, T, V]
            feats, target_logits = self.features_and_teacher(batch)
            target_next = target_logits.argmax(-1) if self.hp.labels == "target" else None
        elif self.hp.labels == "target" and "target_next" not in batch:
            feats, target_next = self.features_and_next(batch)
        else:
            feats = self.features(batch)
        blocks = _to(self._train_blocks(batch, target_next), self.device)
        labels, label_mask = blocks.labels, blocks.label_mask
        vocab = self.loss_vocab_ids
        if self.hp.loss_vocab == "sampled":  # logits [B, N, Bk, V'] over this step's sampled vocabulary
            sampled = sample_vocabulary(labels, label_mask, self.lm_head_weight.shape[0], self.hp.loss_negatives,
                                        self._generator(-1 - self.global_step))
            rows = self.lm_head_weight.index_select(0, sampled.ids)  # [V', H]
            base, final = draft_block_logits(self.draft, self.embed, lambda z: F.linear(z, rows.to(z.dtype)), feats,
                                             blocks, vocab_ids=sampled.ids)
            base, final = sampled.shift(base), None if final is None else sampled.shift(final)
            labels = sampled.columns(labels)
        elif vocab is None:
            base, final = draft_block_logits(self.draft, self.embed, self.lm_head, feats, blocks)
        else:  # logits [B, N, Bk, V'], labels as columns of the loss vocabulary
            base, final = draft_block_logits(self.draft, self.embed, self.loss_lm_head, feats, blocks, vocab_ids=vocab)
            columns = self.loss_vocab_index[labels]
            labels, label_mask = columns.clamp(min=0), label_mask & (columns >= 0)
        distill = None if target_logits is None else self.distill_term(target_logits, blocks, label_mask, vocab)
        lam = self.curriculum()
        loss, loss_base, loss_final = domino_loss(base, final, labels, label_mask, self.slot_weights, lam,
                                                    ce=self.row_ce(), distill=distill)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log("train/loss_base", loss_base, batch_size=bs)
        self.log("train/loss_final", loss_final, batch_size=bs)
        self.log("train/lambda", lam, batch_size=bs)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=bs)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_head = BlockAccuracy(self.draft.config.block_size)
        self.val_base = BlockAccuracy(self.draft.config.block_size)
        self.val_loss_sum, self.val_batches = 0.0, 0
        self.walks = empty_walks()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = None
        if self.hp.val_walk_temperature is not None and "target_hidden" not in batch:  # one forward for both
            feats, logits = self.features_and_teacher(batch)
        else:
            feats = self.features(batch)
        blocks = _to(self._blocks(batch, self._generator(10**9 + batch_idx)), self.device)  # fixed anchors
        base, final = draft_block_logits(self.draft, self.embed, self.lm_head, feats, blocks)
        _, loss_base, loss_final = domino_loss(base, final, blocks.labels, blocks.label_mask, self.slot_weights, 0.0,
                                                 ce=self.row_ce())
        self.val_base.update(base, blocks.labels, blocks.label_mask)
        self.val_head.update(final if final is not None else base, blocks.labels, blocks.label_mask)
        self.val_loss_sum += float(loss_final)
        self.val_batches += 1
        walks = self.walk_batch(batch, feats, logits)
        for key, stats in walks.items():
            self.walks[key].merge(stats)

    def walk_batch(self, batch: dict[str, torch.Tensor], feats: Optional[torch.Tensor] = None,
                   logits: Optional[torch.Tensor] = None) -> dict[str, WalkStats]:
        """Engine-faithful τ of one val batch -> {"head", "base", and with train.val_walk_temperature
        "head_sampled", "base_sampled"}: each sequence's first reply walked round by round
        (train/walk.py), K = B - 1 drafts per round as the engine verifies by default, head on and
        off, over the reply's first `train.val_walk_tokens` tokens (what evaluate decodes); sampled,
        the expected walk under rejection sampling at that T. `feats` [B, T, n*H] and the target's
        `logits` [B, T, V] are computed here where not given (one target forward)."""
        K = self.draft.config.block_size - 1
        temperatures: dict[str, Optional[float]] = {"": None}  # walk-key suffix -> temperature
        if self.hp.val_walk_temperature is not None:
            temperatures["_sampled"] = self.hp.val_walk_temperature
            if logits is None:
                feats_now, logits = self.features_and_teacher(batch)
                feats = feats_now if feats is None else feats
        if feats is None:
            feats = self.features(batch)
        heads = (True, False) if self.draft.config.use_domino_head else (False,)
        out = {f"{h}{s}": WalkStats() for h in ("head", "base") for s in temperatures}
        for b in range(batch["input_ids"].shape[0]):
            n = int(batch["lengths"][b])
            ids, mask = batch["input_ids"][b, :n].to(self.device), batch["loss_mask"][b, :n]
            for head in heads:
                for suffix, temperature in temperatures.items():
                    stats = walk_sequence(self.draft, self.embed, self.lm_head, ids, mask, feats[b, :n], K, head=head,
                                          horizon=self.hp.val_walk_tokens, temperature=temperature,
                                          target_logits=None if logits is None else logits[b, :n])
                    out[("head" if head else "base") + suffix].merge(stats)
        if not self.draft.config.use_domino_head:  # head off: the head's walk is the base's
            for suffix in temperatures:
                out["head" + suffix] = out["base" + suffix]
        return out

    def on_validation_epoch_end(self) -> None:
        if self.trainer.world_size > 1:
            self._pool_ranks()
        head, base = self.val_head, self.val_base
        self.last_summary = {
            "acceptance_length": head.acceptance_length(),
            "acceptance_length_base": base.acceptance_length(),
            "accuracy_by_position": head.prefix_accuracy(),
            "accuracy_by_position_base": base.prefix_accuracy(),
            "loss": self.val_loss_sum / max(1, self.val_batches),
            **{walk_name(key): stats.as_dict() for key, stats in self.walks.items() if stats.rounds},
        }
        self.last_summary.setdefault("walk", self.walks["head"].as_dict())
        self.last_summary.setdefault("walk_base", self.walks["base"].as_dict())
        self.log("val/acceptance_length", self.last_summary["acceptance_length"], sync_dist=False)
        self.log("val/acceptance_length_base", self.last_summary["acceptance_length_base"], sync_dist=False)
        self.log("val/loss", self.last_summary["loss"], sync_dist=True)
        for key, stats in self.walks.items():  # val/walk_acceptance_length[_base][_sampled]
            if stats.rounds:
                self.log(f"val/walk_acceptance_length{walk_name(key)[4:]}", stats.acceptance_length, sync_dist=False)
        for k, (a, b) in enumerate(zip(head.prefix_accuracy(), base.prefix_accuracy())):
            self.log(f"val/accuracy_pos{k + 1}", a, sync_dist=False)
            self.log(f"val/accuracy_base_pos{k + 1}", b, sync_dist=False)

    def _pool_ranks(self) -> None:
        """DDP: each rank validated its stride of the val split -> every rank holds the totals of all:
        accuracy counts, walks (τ, its per-reply SE, acceptance by position) and the loss."""
        import torch.distributed as dist

        for acc in (self.val_head, self.val_base):
            acc.right = self.all_gather(acc.right.to(self.device)).sum(0).cpu().reshape(-1)
            acc.counted = self.all_gather(acc.counted.to(self.device)).sum(0).cpu().reshape(-1)
        gathered: list[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, (self.walks, self.val_loss_sum, self.val_batches))
        walks = empty_walks()
        for rank_walks, _, _ in gathered:
            for key, stats in rank_walks.items():
                walks[key].merge(stats)
        self.walks = walks
        self.val_loss_sum = sum(g[1] for g in gathered)
        self.val_batches = sum(g[2] for g in gathered)

    def final_validation(self) -> dict[str, Any]:
        """Summary of the last validation pass (acceptance lengths, accuracy by position, loss)."""
        return dict(self.last_summary)

    # ---- optimisation --------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW on the draft's parameters; linear warm-up then cosine to lr * min_lr_ratio (on `schedule_step`)."""
        hp = self.hp
        opt = torch.optim.AdamW(self.draft.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95))
        total = max(1, self.trainer.max_steps)
        warmup = max(1, int(hp.warmup_fraction * total))

        def factor(step: int) -> float:
            step = self.schedule_step(step)
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def empty_walks() -> dict[str, WalkStats]:
    """The val walks one validation pools: head on / off, greedy and sampled (walk_batch's keys)."""
    return {f"{h}{s}": WalkStats() for h in ("head", "base") for s in ("", "_sampled")}


def walk_name(key: str) -> str:
    """A walk_batch key -> its summary name: head -> walk, base -> walk_base, head_sampled -> walk_sampled."""
    return "walk" + key.replace("head", "").replace("base", "_base")


def _to(blocks: Any, device: torch.device) -> Any:
    """Move every tensor field of a BlockBatch to `device`."""
    import dataclasses

    return dataclasses.replace(blocks, **{
        f.name: getattr(blocks, f.name).to(device) for f in dataclasses.fields(blocks)
        if isinstance(getattr(blocks, f.name), torch.Tensor)
    })
