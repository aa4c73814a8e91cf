"""Writing the cache: shard plan, batched target forwards, atomic shard writes, resume.

The plan is a pure function of the sequence lengths and `shard_tokens`, so a re-run makes the same
shards in the same order and can continue after the last complete one. Within a shard, sequences
are sorted by length (longest first) and batched by a padded-token budget, which keeps padding low
without changing where any sequence is stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save as safetensors_bytes

from dominospec import files
from dominospec.cache import format as fmt
from dominospec.cache.features import target_hidden_and_next
from dominospec.errors import UserError

DISK_MARGIN = 1.05  # the estimate is multiplied by this ...
DISK_RESERVE = 256 * 2**20  # ... and this many bytes are kept free for everything else


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[range]:
    """Sequence lengths (dataset order) -> row ranges, one per shard, covering all rows in order.

    A shard takes sequences while its token count stays <= shard_tokens; a longer sequence gets a shard alone.
    """
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append(range(start, len(lengths)))
    return shards


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Lengths of one shard's sequences -> batches of their indices, longest first.

    Invariant: len(batch) * (longest in batch) <= batch_tokens, or the batch is one sequence.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def check_disk(root: Path, tokens: int, bytes_per_token: int, reclaimable: int = 0) -> int:
    """Refuse (UserError) when `tokens` more cached tokens would not fit -> bytes needed.

    Free space is that of root's filesystem plus `reclaimable` bytes about to be deleted.
    """
    need = tokens * bytes_per_token
    free = files.free_bytes(root) + reclaimable
    if need * DISK_MARGIN + DISK_RESERVE > free:
        raise UserError(
            f"not enough disk for the cache at {root}: {tokens:,} tokens x {bytes_per_token:,} B/token "
            f"= {need / 2**30:.2f} GiB needed (+5% and {DISK_RESERVE // 2**20} MiB margin), "
            f"{free / 2**30:.2f} GiB free; lower cache.max_train_conversations or free space"
        )
    return need


def resume_point(root: Path, planned: fmt.Manifest) -> fmt.Manifest:
    """Cache dir + the manifest this run would write -> the manifest to continue from (reads only).

    Same header (fingerprint, target, layers, dtype, ...) -> keep each split's verified prefix of
    shards (a missing or corrupt shard and all after it are redone). Anything else -> start afresh.
    """
    try:
        old = fmt.read_manifest(root)
    except fmt.CacheError:
        return planned
    if _header(old) != _header(planned):
        return planned
    manifest = planned
    for split in planned.splits:
        manifest = manifest.with_shards(split, _verified_prefix(root, old.splits[split].shards))
    return manifest


def stale_files(root: Path, manifest: fmt.Manifest) -> list[Path]:
    """Cache files in root that `manifest` does not list: old shards, temporary files, old manifest."""
    if not root.is_dir():
        return []
    listed = {s.file for s in manifest.shards}
    return [p for p in sorted(root.iterdir()) if p.is_file() and fmt.is_cache_file(p.name) and p.name not in listed]


def start_from(root: Path, manifest: fmt.Manifest) -> None:
    """Make root hold exactly `manifest` and its shards: delete stale cache files, write the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    for path in stale_files(root, manifest):
        path.unlink()
    fmt.write_manifest(root, manifest)


def _header(manifest: fmt.Manifest) -> fmt.Manifest:
    """The manifest without its shard lists: what must match for shards to be reused."""
    return dataclasses.replace(
        manifest, splits={k: dataclasses.replace(v, shards=()) for k, v in manifest.splits.items()}
    )


def _verified_prefix(root: Path, shards: Sequence[fmt.ShardInfo]) -> list[fmt.ShardInfo]:
    kept = []
    for shard in shards:
        path = root / shard.file
        if not path.is_file() or files.sha256_file(path) != shard.sha256:
            break
        kept.append(shard)
    return kept


def check_rows(rows: dict[str, list[Any]], vocab_size: int, where: str, first_row: int) -> None:
    """Raise UserError naming the row when a sequence is empty, ids leave the vocab, or masks disagree."""
    for k, (row_id, ids, mask) in enumerate(zip(rows["id"], rows["input_ids"], rows["loss_mask"])):
        problem = None
        if not ids:
            problem = "no tokens"
        elif len(mask) != len(ids):
            problem = f"loss_mask has {len(mask)} entries for {len(ids)} tokens"
        elif min(ids) < 0 or max(ids) >= vocab_size:
            bad = max(ids) if max(ids) >= vocab_size else min(ids)
            problem = f"token id {bad} outside the target vocab 0..{vocab_size - 1}"
        elif any(m not in (0, 1) for m in mask):
            problem = "loss_mask holds values other than 0/1"
        if problem:
            raise UserError(f"{where} row {first_row + k} (id {row_id!r}): {problem}")


def compute_shard(
    model: torch.nn.Module,
    rows: dict[str, list[Any]],
    layer_ids: list[int],
    batch_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    on_tokens: Callable[[int], None] = lambda n: None,
) -> dict[str, torch.Tensor]:
    """One shard's rows {'input_ids': [[int]], 'loss_mask': [[0/1]]} -> the shard tensors (format.py).

    Sequences stay in row order in the shard; they are batched longest first, right-padded.
    """
    lengths = [len(ids) for ids in rows["input_ids"]]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    input_ids = torch.tensor([t for ids in rows["input_ids"] for t in ids], dtype=torch.int64)  # [N]
    loss_mask = torch.tensor([m for mask in rows["loss_mask"] for m in mask], dtype=torch.uint8)  # [N]
    hidden: torch.Tensor | None = None  # [N, n*H], allocated once the width is known
    target_next = torch.empty_like(input_ids)  # [N] the target's greedy token after each position
    for batch in plan_batches(lengths, batch_tokens):
        width = lengths[batch[0]]  # longest first
        ids = torch.zeros(len(batch), width, dtype=torch.int64)  # [b, T]; pad id 0 is masked out
        mask = torch.zeros(len(batch), width, dtype=torch.int64)  # [b, T]; 1 = real token
        for j, i in enumerate(batch):
            ids[j, : lengths[i]] = input_ids[offsets[i] : offsets[i + 1]]
            mask[j, : lengths[i]] = 1
        feats, nxt = target_hidden_and_next(model, ids.to(device), mask.to(device), layer_ids)  # [b, T, n*H], [b, T]
        feats, nxt = feats.to("cpu", dtype), nxt.cpu()
        if hidden is None:
            hidden = torch.empty(int(offsets[-1]), feats.shape[-1], dtype=dtype)
        for j, i in enumerate(batch):
            hidden[offsets[i] : offsets[i + 1]] = feats[j, : lengths[i]]
            target_next[offsets[i] : offsets[i + 1]] = nxt[j, : lengths[i]]
        on_tokens(sum(lengths[i] for i in batch))
    assert hidden is not None, "a shard holds at least one sequence"
    return fmt.shard_tensors(input_ids, loss_mask, hidden, offsets, target_next)


def write_shard(
    root: Path, split: str, index: int, tensors: dict[str, torch.Tensor], seconds: float
) -> fmt.ShardInfo:
    """Shard tensors (computed in `seconds`) -> `root/<split>-<index>.safetensors` (temp + rename) -> ShardInfo."""
    name = fmt.shard_name(split, index)
    data = safetensors_bytes(tensors, metadata={"format_version": str(fmt.FORMAT_VERSION)})
    files.write_atomic(root / name, data)
    return fmt.ShardInfo(
        file=name,
        sequences=tensors[fmt.OFFSETS].shape[0] - 1,
        tokens=tensors[fmt.INPUT_IDS].shape[0],
        sha256=hashlib.sha256(data).hexdigest(),
        seconds=round(seconds, 3),
    )
