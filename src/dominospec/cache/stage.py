"""DVC stage `cache`: run the target over train/val conversations and store its features.

Reads `paths.regenerated` (a DatasetDict + meta.json), writes `paths.cache` (format.py) and
`paths.metrics/cache.json`. A re-run with the same target, data and cache settings continues
after the last complete shard; anything else starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dominospec import files
from dominospec.cache import format as fmt
from dominospec.cache.features import resolve_layer_ids
from dominospec.cache.writer import (
    check_disk,
    check_rows,
    compute_shard,
    plan_shards,
    resume_point,
    stale_files,
    start_from,
    write_shard,
)
from dominospec.errors import UserError
from dominospec.precision import dtype_name, resolve_dtype
from dominospec.config import CacheParams, Params
from dominospec.data.dataset import META_FILE, read_dataset
from dominospec.target import load_target, pick_device

REQUIRED_COLUMNS = ("id", "input_ids", "loss_mask")


@dataclass(frozen=True)
class Source:
    """The conversations to cache: the first N rows of each split, with their lengths."""

    meta_json: bytes  # meta.json as written by the regenerate stage (dominospec.data.dataset)
    meta: dict[str, Any]
    splits: dict[str, Any]  # split -> datasets.Dataset (first N rows)
    lengths: dict[str, list[int]]  # split -> tokens per row
    split_sizes: dict[str, int]  # split -> rows in the source split (before the cap)
    digests: dict[str, str]  # split -> sha256 of the cached rows' ids, token ids and loss masks (`rows_digest`)


def check_params(params: CacheParams) -> None:
    """Raise UserError for cache settings no run can use (checked before any work)."""
    for key in ("num_feature_layers", "batch_tokens", "shard_tokens"):
        if getattr(params, key) < 1:
            raise UserError(f"cache.{key} must be >= 1, got {getattr(params, key)}")
    for key in ("max_train_conversations", "max_val_conversations"):
        if getattr(params, key) is not None and getattr(params, key) < 1:
            raise UserError(f"cache.{key} must be >= 1 or null (all), got {getattr(params, key)}")


def read_source(data_dir: Path, params: CacheParams) -> Source:
    """`paths.regenerated` -> Source, capped by max_{train,val}_conversations. UserError when unusable."""
    import pyarrow.compute as pc

    data, meta = read_dataset(data_dir)  # checks meta.json's format version and the splits
    meta_json = (data_dir / META_FILE).read_bytes()
    if not isinstance(meta.get("mask_token_id"), int):
        raise UserError(f"{data_dir / META_FILE}: mask_token_id must be an int, got {meta.get('mask_token_id')!r}")
    caps = {"train": params.max_train_conversations, "val": params.max_val_conversations}
    splits, lengths, sizes = {}, {}, {}
    for split, cap in caps.items():
        ds = data[split]
        missing = [c for c in REQUIRED_COLUMNS if c not in ds.column_names]
        if missing:
            raise UserError(f"{data_dir} {split}: missing columns {missing}")
        sizes[split] = len(ds)
        ds = ds.select(range(min(len(ds), cap if cap is not None else len(ds))))
        if len(ds) == 0:
            raise UserError(f"{data_dir} {split}: no conversations to cache")
        splits[split] = ds
        lengths[split] = pc.list_value_length(ds.with_format("arrow")["input_ids"]).to_pylist()
    digests = {split: rows_digest(ds) for split, ds in splits.items()}
    return Source(meta_json=meta_json, meta=meta, splits=splits, lengths=lengths, split_sizes=sizes, digests=digests)


def rows_digest(ds: Any) -> str:
    """The rows a cache is computed from -> sha256 hex of their REQUIRED_COLUMNS. meta.json alone does
    not name the content: a regenerate run whose batch size or dtype changed writes the same meta and
    other replies (bf16 rounds differently per batch), and the cache and a resumed train stage must
    see that as new data."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    h = hashlib.sha256()
    for column in REQUIRED_COLUMNS:
        values = table[column]
        if pa.types.is_list(values.type):
            h.update(pc.list_value_length(values).to_numpy(zero_copy_only=False).tobytes())
            values = pc.list_flatten(values)
            h.update(values.to_numpy(zero_copy_only=False).tobytes())
        else:
            h.update(json.dumps(values.to_pylist()).encode())
    return h.hexdigest()


def cache(params: Params) -> None:
    """Params -> `paths.cache` (shards + manifest.json) and `paths.metrics`/cache.json."""
    started = time.perf_counter()
    cp = params.cache
    check_params(cp)
    source = read_source(Path(params.paths.regenerated), cp)
    device = pick_device(params.target.device)
    if device.type == "cpu":
        torch.set_num_threads(_usable_cores())
    target = load_target(params.target, device=device)
    if not target.identity.same_model(source.meta.get("target", {})):
        raise UserError(
            f"{params.paths.regenerated} was tokenized for target {source.meta.get('target', {}).get('name')!r}, "
            f"but target.model loads {target.identity.name!r}: re-run prepare/regenerate for this target"
        )
    cp = dataclasses.replace(cp, compute_dtype=resolve_dtype(cp.compute_dtype, target.device))  # the manifest holds what ran
    if cp.compute_dtype is not None:  # features need not be bit-exact: bf16 runs several times faster than fp32 on an AVX-512 BF16 CPU (journal)
        target.model.to(fmt.DTYPES[cp.compute_dtype])
    loaded = time.perf_counter()
    layer_ids = resolve_layer_ids(cp, target.num_layers)
    plans = {split: plan_shards(source.lengths[split], cp.shard_tokens) for split in fmt.SPLITS}
    planned = planned_manifest(source, target.identity.as_dict(), target.hidden_size, layer_ids, cp)
    root = Path(params.paths.cache)
    manifest = resume_point(root, planned)
    resumed = {split: len(manifest.splits[split].shards) for split in fmt.SPLITS}
    remaining = sum(info.planned_tokens - info.tokens for info in manifest.splits.values())
    reclaimable = sum(p.stat().st_size for p in stale_files(root, manifest))
    check_disk(root, remaining, manifest.bytes_per_token, reclaimable)
    start_from(root, manifest)
    tqdm.write(
        f"cache: {remaining:,} tokens to compute, layers {layer_ids}, {manifest.bytes_per_token:,} B/token"
        + (f", resuming after {resumed} shards" if any(resumed.values()) else ""),
        file=sys.stderr,
    )

    dtype = fmt.DTYPES[cp.dtype]
    with tqdm(total=remaining, unit="tok", unit_scale=True, desc="cache", dynamic_ncols=True) as bar:
        for split in fmt.SPLITS:
            ds = source.splits[split]
            for index, rows in enumerate(plans[split]):
                if index < resumed[split]:
                    continue
                shard_started = time.perf_counter()
                batch = ds[rows.start : rows.stop]
                check_rows(batch, target.identity.vocab_size, f"{params.paths.regenerated} {split}", rows.start)
                tensors = compute_shard(
                    target.model, batch, layer_ids, cp.batch_tokens, dtype, device, on_tokens=bar.update
                )
                shard = write_shard(root, split, index, tensors, seconds=time.perf_counter() - shard_started)
                manifest = manifest.with_shard(split, shard)
                fmt.write_manifest(root, manifest)
    run = {"computed_tokens": remaining, "seconds": time.perf_counter() - started, "load_seconds": loaded - started,
           "compute_dtype": dtype_name(target.model)}
    write_metrics(Path(params.paths.metrics) / "cache.json", root, manifest, run)


def planned_manifest(
    source: Source, identity: dict[str, Any], hidden_size: int, layer_ids: list[int], params: CacheParams
) -> fmt.Manifest:
    """What this run's cache will be once complete -> Manifest with no shards yet."""
    content = {  # the cache settings that change what the shards hold
        "layer_ids": layer_ids,
        "dtype": params.dtype,
        "compute_dtype": params.compute_dtype,
        "shard_tokens": params.shard_tokens,
        "sequences": {split: len(source.lengths[split]) for split in fmt.SPLITS},
        "rows": source.digests,
        "code": files.code_digest(),  # other code may compute other features: never continue its shards
    }
    return fmt.Manifest(
        format_version=fmt.FORMAT_VERSION,
        target=identity,
        layer_ids=tuple(layer_ids),
        hidden_size=hidden_size,
        feature_dim=len(layer_ids) * hidden_size,
        dtype=params.dtype,
        mask_token_id=source.meta["mask_token_id"],
        fingerprint=fmt.data_fingerprint(source.meta_json, source.split_sizes, content),
        splits={
            split: fmt.SplitInfo(planned_sequences=len(lengths), planned_tokens=sum(lengths))
            for split, lengths in source.lengths.items()
        },
    )


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def write_metrics(path: Path, root: Path, manifest: fmt.Manifest, run: dict[str, float]) -> None:
    """Complete cache + this run's timings -> `path` (metrics/cache.json), written atomically.

    `tokens_per_s` covers the whole cache, from the per-shard times in the manifest, so it stays
    meaningful when the cache was built over several (resumed) runs or a re-run had nothing to do.
    """
    shard_seconds = sum(s.seconds for s in manifest.shards)
    tokens = sum(s.tokens for s in manifest.shards)
    metrics = {
        "tokens": tokens,
        "sequences": sum(s.sequences for s in manifest.shards),
        "tokens_per_s": round(tokens / shard_seconds, 1) if shard_seconds > 0 else None,
        "bytes_per_token": manifest.bytes_per_token,
        "shards": len(manifest.shards),
        "layer_ids": list(manifest.layer_ids),
        "feature_dim": manifest.feature_dim,
        "dtype": manifest.dtype,
        "compute_dtype": run.get("compute_dtype"),  # the target's dtype for the features (cache.compute_dtype)
        "splits": {
            split: {"sequences": info.sequences, "tokens": info.tokens, "shards": len(info.shards)}
            for split, info in manifest.splits.items()
        },
        "shard_seconds": round(shard_seconds, 2),  # target forwards + writes, summed over all runs
        "seconds": round(run["seconds"], 2),  # this run, model load included
        "load_seconds": round(run["load_seconds"], 2),
        "computed_tokens": run["computed_tokens"],  # this run; 0 when the cache was already complete
        "num_threads": torch.get_num_threads(),
        "disk_bytes": sum((root / s.file).stat().st_size for s in manifest.shards)
        + (root / fmt.MANIFEST_NAME).stat().st_size,
        "target": manifest.target,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(path, (json.dumps(metrics, indent=2) + "\n").encode())
