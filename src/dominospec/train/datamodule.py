"""Training data: sequences of (token ids, loss mask, target features) for the draft.

Two feature modes (params `train.features`):
  - `cache`: sequences come from the hidden-state cache (`CacheReader`), features included;
  - `online`: sequences come from the prepared dataset, and the LightningModule computes the
    target features inside the step (for caches that would not fit on disk).

A batch is a dict of right-padded tensors:
  input_ids [B, T] long, loss_mask [B, T] bool (False on padding), lengths [B] long,
  target_hidden [B, T, n*H] and target_next [B, T] long (cache mode only; the target's greedy
  token after each position, for `train.labels: target`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from dominospec.cache.reader import CacheReader

GROUP_BATCHES = 64  # train.group_by_length: batches per length group (sorted together, then shuffled)


class PreparedSequences(Dataset):
    """Token ids and loss masks of one split of a prepared/regenerated dataset (online mode)."""

    def __init__(self, root: Path, split: str, limit: Optional[int] = None):
        from datasets import load_from_disk

        data = load_from_disk(str(root))[split]
        if limit is not None:
            data = data.select(range(min(limit, len(data))))
        self.data = data.with_format("torch", columns=["input_ids", "loss_mask"])

    def __len__(self) -> int:
        return len(self.data)

    def lengths(self) -> list[int]:
        """Tokens of each sequence [n]."""
        return [len(ids) for ids in self.data.with_format(None)["input_ids"]]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.data[i]
        return {"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].bool()}


class CachedSequences(Dataset):
    """A split of the hidden-state cache, at most `limit` sequences."""

    def __init__(self, reader: CacheReader, limit: Optional[int] = None):
        self.reader = reader
        self.size = len(reader) if limit is None else min(limit, len(reader))

    def __len__(self) -> int:
        return self.size

    def lengths(self) -> list[int]:
        """Tokens of each sequence [n]."""
        return self.reader.lengths()[: self.size]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.reader[i]


class StepBatchSampler(torch.utils.data.Sampler):
    """Batches as a pure function of the optimiser step, so a resumed run sees the batches an
    uninterrupted one would. Each pass over the data (epoch e) is a seeded permutation; rank r
    takes its stride of each batch of bs * world items. Yields the batches of steps
    start_step .. total_steps-1.

    Without `lengths` the steps read the permutations as one endless stream: step s takes items
    s*bs*world .. of it. With `lengths` [n] (tokens per item) the batches are grouped by length:
    each epoch's permutation is cut into groups of GROUP_BATCHES batches, a group is sorted by
    length and cut into batches, and the epoch's batches are shuffled (the items of an epoch that
    do not fill a batch wait for no one: the next epoch is a new permutation). A batch is padded to
    its longest item, so on random batches of ShareGPT turns most of the target's and the draft's
    context rows are padding, and grouped batches pad little (the shares are in docs/journal/)."""

    def __init__(self, num_items: int, batch_size: int, seed: int, start_step: int, total_steps: int,
                 rank: int = 0, world_size: int = 1, lengths: Optional[list[int]] = None):
        self.n, self.bs, self.seed = num_items, batch_size, seed
        self.start, self.total, self.rank, self.world = start_step, total_steps, rank, world_size
        per_step = batch_size * world_size
        self.lengths = lengths if lengths is not None and num_items >= per_step else None
        assert self.lengths is None or len(self.lengths) == num_items
        self._perm: tuple[int, list[int]] = (-1, [])  # (epoch, its permutation): the last one drawn
        self._batches: tuple[int, list[list[int]]] = (-1, [])  # (epoch, its grouped batches)

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist())
        return self._perm[1]

    def _grouped(self, epoch: int) -> list[list[int]]:
        """Epoch -> its batches of bs * world items of similar length, in a seeded order."""
        if self._batches[0] != epoch:
            perm, per_step = self._permutation(epoch), self.bs * self.world
            perm = perm[: len(perm) - len(perm) % per_step]
            batches = []
            for g in range(0, len(perm), per_step * GROUP_BATCHES):
                group = sorted(perm[g : g + per_step * GROUP_BATCHES], key=lambda i: (self.lengths[i], i))
                batches += [group[k : k + per_step] for k in range(0, len(group), per_step)]
            order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(self.seed + epoch + (1 << 31)))
            self._batches = (epoch, [batches[i] for i in order.tolist()])
        return self._batches[1]

    def _batch(self, step: int) -> list[int]:
        """Step -> the items of this rank's share of its batch."""
        per_step = self.bs * self.world
        if self.lengths is None:
            first = step * per_step + self.rank * self.bs
            return [self._item(p) for p in range(first, first + self.bs)]
        epoch, index = divmod(step, self.n // per_step)
        return self._grouped(epoch)[index][self.rank * self.bs : (self.rank + 1) * self.bs]

    def _item(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        return self._permutation(epoch)[offset]

    def __iter__(self):
        for step in range(self.start, self.total):
            yield self._batch(step)

    def __len__(self) -> int:
        # The whole run is one epoch of `total` batches; a resumed epoch has already counted
        # `start` of them, so the length stays `total` while iteration begins at `start`.
        return self.total


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad a list of sequences into one batch (see module docstring for shapes)."""
    lengths = torch.tensor([len(it["input_ids"]) for it in items])
    T = int(lengths.max())
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.zeros(len(items), T, dtype=torch.long),
        "loss_mask": torch.zeros(len(items), T, dtype=torch.bool),
        "lengths": lengths,
    }
    if "target_hidden" in items[0]:
        F = items[0]["target_hidden"].shape[-1]
        batch["target_hidden"] = torch.zeros(len(items), T, F, dtype=items[0]["target_hidden"].dtype)
    if "target_next" in items[0]:
        batch["target_next"] = torch.zeros(len(items), T, dtype=torch.long)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        batch["input_ids"][b, :n] = it["input_ids"]
        batch["loss_mask"][b, :n] = it["loss_mask"]
        if "target_hidden" in batch:
            batch["target_hidden"][b, :n] = it["target_hidden"]
        if "target_next" in batch:
            batch["target_next"][b, :n] = it["target_next"]
    return batch


class DraftDataModule(L.LightningDataModule):
    """Train/val loaders over the cache (or the prepared data in online mode)."""

    def __init__(
        self,
        features: str,
        cache_dir: Path,
        data_dir: Path,
        batch_size: int,
        val_max_sequences: int,
        num_workers: int,
        seed: int,
        train_limit: Optional[int] = None,
        group_by_length: bool = False,
    ):
        super().__init__()
        self.group_by_length = group_by_length
        self.features, self.cache_dir, self.data_dir = features, Path(cache_dir), Path(data_dir)
        self.batch_size, self.val_max_sequences = batch_size, val_max_sequences
        self.num_workers, self.seed, self.train_limit = num_workers, seed, train_limit
        self.train_set: Any = None
        self.val_set: Any = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        if self.features == "cache":
            self.train_set = CachedSequences(CacheReader(self.cache_dir, "train"), self.train_limit)
            self.val_set = CachedSequences(CacheReader(self.cache_dir, "val"), self.val_max_sequences)
        else:
            self.train_set = PreparedSequences(self.data_dir, "train", self.train_limit)
            self.val_set = PreparedSequences(self.data_dir, "val", self.val_max_sequences)

    def train_dataloader(self) -> DataLoader:
        """Called after a checkpoint is restored: starts at the restored optimiser step."""
        trainer = self.trainer
        sampler = StepBatchSampler(
            len(self.train_set), self.batch_size, self.seed,
            start_step=trainer.global_step, total_steps=trainer.max_steps,
            rank=trainer.global_rank, world_size=trainer.world_size,
            lengths=self.train_set.lengths() if self.group_by_length else None,
        )
        return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Validation: each rank takes its stride of the (capped) val split, in order."""
        trainer = self.trainer
        indices = list(range(trainer.global_rank, len(self.val_set), trainer.world_size))
        subset = torch.utils.data.Subset(self.val_set, indices)
        return DataLoader(subset, batch_size=self.batch_size, shuffle=False, collate_fn=collate,
                          num_workers=self.num_workers)
