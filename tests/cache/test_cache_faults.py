"""Faults: corrupt and missing shards, incomplete splits, another target, no disk, a disk that fills up."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from cache_helpers import save_regenerated, write_params

from dominospec.cache import format as fmt
from dominospec.cache.reader import CacheReader
from dominospec.cache.stage import cache
from dominospec.errors import UserError
from dominospec.config import load_params

SIZES = {"train": 16, "val": 4, "test": 2}
KNOBS = dict(num_feature_layers=2, layer_ids=None, max_train_conversations=None, max_val_conversations=None,
             batch_tokens=128, shard_tokens=120, dtype="bfloat16")


@pytest.fixture
def built(tmp_path, tiny_targets, loaded_targets):
    """A complete cache from the tiny Llama -> (params, cache dir)."""
    save_regenerated(tmp_path / "regenerated", loaded_targets["llama"].identity.as_dict(), SIZES)
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **KNOBS))
    cache(params)
    return params, Path(params.paths.cache)


def _shard_sha(root: Path) -> dict[str, str]:
    m = fmt.read_manifest(root)
    return {s.file: s.sha256 for info in m.splits.values() for s in info.shards}


def test_corrupt_shard_is_named_and_repaired_by_a_rerun(built):
    params, root = built
    original = _shard_sha(root)
    assert len([f for f in original if f.startswith("train")]) >= 3
    victim = root / fmt.shard_name("train", 1)
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40  # one bit inside target_hidden (the last tensor bytes)
    victim.write_bytes(bytes(data))

    with pytest.raises(fmt.CacheError, match=r"train-00001\.safetensors: shard is corrupt"):
        CacheReader(root, "train", verify=True)
    lazy = CacheReader(root, "train", verify=False)
    first_of_shard_1 = fmt.read_manifest(root).splits["train"].shards[0].sequences
    assert lazy[0]["input_ids"].numel() > 0  # shard 0 is fine
    with pytest.raises(fmt.CacheError, match=r"train-00001\.safetensors: shard is corrupt"):
        lazy[first_of_shard_1]

    cache(params)  # the re-run keeps shard 0, recomputes shard 1 and everything after it
    assert _shard_sha(root) == original
    assert len(CacheReader(root, "train")) == SIZES["train"]


def test_missing_shard_is_named(built):
    _, root = built
    (root / fmt.shard_name("val", 0)).unlink()
    with pytest.raises(fmt.CacheError, match=r"val-00000\.safetensors: shard listed in the manifest is missing"):
        CacheReader(root, "val", verify=False)


def test_incomplete_split_and_unknown_split_are_refused(built):
    _, root = built
    m = fmt.read_manifest(root)
    fmt.write_manifest(root, m.with_shards("train", m.splits["train"].shards[:-1]))
    with pytest.raises(fmt.CacheError, match=r"split 'train' is incomplete \(\d+ of 16 sequences\)"):
        CacheReader(root, "train")
    with pytest.raises(fmt.CacheError, match="no split 'test'"):
        CacheReader(root, "test")


def test_tensor_layout_is_checked_against_the_manifest(built):
    _, root = built
    m = fmt.read_manifest(root)
    fmt.write_manifest(root, dataclasses.replace(m, feature_dim=m.feature_dim * 2))
    reader = CacheReader(root, "val")
    with pytest.raises(fmt.CacheError, match=r"val-00000\.safetensors: tensor 'target_hidden' is BF16 \[\d+, 64\], expected BF16"):
        reader[0]


def test_cache_from_another_target_is_refused(built, loaded_targets):
    _, root = built
    reader = CacheReader(root, "train")
    reader.check_target(loaded_targets["llama"].identity)
    with pytest.raises(fmt.CacheError, match="cache made from target 'llama'.*not 'qwen3'"):
        reader.check_target(loaded_targets["qwen3"].identity.as_dict())


def test_items_are_copies(built):
    _, root = built
    reader = CacheReader(root, "train")
    item = reader[4]
    kept = {k: v.clone() for k, v in item.items()}
    item["input_ids"].fill_(-1)
    item["loss_mask"].logical_not_()
    item["target_hidden"].fill_(123.0)
    again = reader[4]
    assert all(torch.equal(again[k], kept[k]) for k in kept)


def test_reader_pickles_without_rehashing(built):
    import pickle

    _, root = built
    reader = CacheReader(root, "train")
    before = reader[5]
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._verified == set(range(len(reader.manifest.splits["train"].shards)))
    after = copy[5]
    assert all((before[k] == after[k]).all() for k in before)


def test_disk_estimate_refuses_before_writing(tmp_path, tiny_targets, loaded_targets, monkeypatch):
    # 137 B/token: 2 layers x 32 x bf16 features (128) + int32 ids + uint8 mask + int32 target_next
    save_regenerated(tmp_path / "regenerated", loaded_targets["llama"].identity.as_dict(), SIZES)
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **KNOBS))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100 * 2**20))
    with pytest.raises(UserError, match=r"not enough disk for the cache at .*cache: [\d,]+ tokens x 137 B/token .* 0\.10 GiB free"):
        cache(params)
    assert not (tmp_path / "cache").exists()


def test_full_disk_while_writing_leaves_no_temp_file(tmp_path, tiny_targets, loaded_targets, monkeypatch):
    save_regenerated(tmp_path / "regenerated", loaded_targets["llama"].identity.as_dict(), SIZES)
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **KNOBS))
    root = Path(params.paths.cache)
    real_fsync, shard_writes = os.fsync, []

    def fsync_fills_the_disk(fd: int) -> None:
        # The third shard's bytes are already in the temporary file when the disk "fills up".
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".safetensors.tmp"):
            shard_writes.append(fd)
            if len(shard_writes) == 3:
                assert (root / (fmt.shard_name("train", 2) + fmt.TEMP_SUFFIX)).stat().st_size > 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_fills_the_disk)
    with pytest.raises(UserError, match=r"disk full while writing .*train-00002\.safetensors .*MiB free"):
        cache(params)
    assert not list(root.glob("*.tmp"))
    assert not (root / fmt.shard_name("train", 2)).exists()
    assert [s.file for s in fmt.read_manifest(root).splits["train"].shards] == [fmt.shard_name("train", i) for i in (0, 1)]

    monkeypatch.setattr(os, "fsync", real_fsync)
    cache(params)
    assert fmt.read_manifest(root).complete and len(CacheReader(root, "train")) == SIZES["train"]


def test_data_for_another_target_is_refused(tmp_path, tiny_targets, loaded_targets):
    save_regenerated(tmp_path / "regenerated", loaded_targets["qwen3"].identity.as_dict(), SIZES)
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **KNOBS))
    with pytest.raises(UserError, match="tokenized for target 'qwen3', but target.model loads 'llama'"):
        cache(params)


def test_bad_rows_are_named(tmp_path, tiny_targets, loaded_targets):
    import datasets

    from dominospec.data.dataset import FEATURES, read_dataset, write_dataset

    data_dir = save_regenerated(tmp_path / "regenerated", loaded_targets["llama"].identity.as_dict(), SIZES)
    data, meta = read_dataset(data_dir)
    rows = data["train"].to_dict()
    rows["input_ids"][9] = rows["input_ids"][9][:-1] + [300]  # vocab is 0..299
    write_dataset(data_dir, datasets.DatasetDict({**data, "train": datasets.Dataset.from_dict(rows, features=FEATURES)}), meta)
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **KNOBS))
    with pytest.raises(UserError, match=r"train row 9 \(id 'train-9'\): token id 300 outside the target vocab 0\.\.299"):
        cache(params)
