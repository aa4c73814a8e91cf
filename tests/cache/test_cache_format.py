"""The cache format and the pure planning functions: manifest round trip, versions, layer ids, plans."""

from __future__ import annotations

import json

import pytest

from dominospec.cache import format as fmt
from dominospec.cache.features import resolve_layer_ids
from dominospec.cache.writer import plan_batches, plan_shards
from dominospec.errors import UserError
from dominospec.config import CacheParams
from dominospec.target import default_layer_ids


def _manifest(**changes) -> fmt.Manifest:
    shard = fmt.ShardInfo(file=fmt.shard_name("train", 0), sequences=3, tokens=40, sha256="ab" * 32, seconds=1.5)
    fields = dict(
        format_version=fmt.FORMAT_VERSION,
        target={"name": "t", "revision": None, "sha256": "cd" * 32, "dtype": "float32",
                "num_layers": 6, "hidden_size": 32, "vocab_size": 300},
        layer_ids=(1, 2),
        hidden_size=32,
        feature_dim=64,
        dtype="bfloat16",
        mask_token_id=7,
        fingerprint="ef" * 32,
        splits={"train": fmt.SplitInfo(5, 70, (shard,)), "val": fmt.SplitInfo(2, 9)},
    )
    fields.update(changes)
    return fmt.Manifest(**fields)


def _cache_params(n: int, layer_ids=None) -> CacheParams:
    return CacheParams(num_feature_layers=n, layer_ids=layer_ids, max_train_conversations=None,
                       max_val_conversations=None, batch_tokens=64, shard_tokens=128, dtype="bfloat16",
                       compute_dtype=None)


def test_manifest_round_trip(tmp_path):
    manifest = _manifest()
    fmt.write_manifest(tmp_path, manifest)
    assert fmt.read_manifest(tmp_path) == manifest
    assert not list(tmp_path.glob("*.tmp"))
    assert manifest.splits["train"].tokens == 40 and not manifest.splits["train"].complete
    grown = manifest.with_shard("val", fmt.ShardInfo("val-00000.safetensors", 2, 9, "00" * 32, 0.25))
    assert grown.splits["val"].complete and not grown.complete and manifest.splits["val"].shards == ()


def test_other_format_version_is_refused(tmp_path):
    fmt.write_manifest(tmp_path, _manifest())
    raw = json.loads((tmp_path / fmt.MANIFEST_NAME).read_text())
    raw["format_version"] = fmt.FORMAT_VERSION + 1
    (tmp_path / fmt.MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(fmt.CacheError, match=f"format version {fmt.FORMAT_VERSION + 1}.*reads version {fmt.FORMAT_VERSION}"):
        fmt.read_manifest(tmp_path)


def test_missing_and_malformed_manifest(tmp_path):
    with pytest.raises(fmt.CacheError, match="no cache manifest"):
        fmt.read_manifest(tmp_path)
    (tmp_path / fmt.MANIFEST_NAME).write_text(json.dumps({"format_version": fmt.FORMAT_VERSION}))
    with pytest.raises(fmt.CacheError, match="malformed cache manifest"):
        fmt.read_manifest(tmp_path)


def test_layer_id_formula():
    # docs/design.md §4: Qwen3-8B (36 layers) -> [1, 9, 17, 25, 33].
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # SmolLM2-135M
    assert resolve_layer_ids(_cache_params(5), 36) == [1, 9, 17, 25, 33]
    assert resolve_layer_ids(_cache_params(3), 6) == [1, 2, 3]
    assert resolve_layer_ids(_cache_params(2, [0, 4]), 6) == [0, 4]


@pytest.mark.parametrize(
    "n, ids, message",
    [
        (2, [1, 2, 3], "has 3 entries but cache.num_feature_layers is 2"),
        (2, [3, 1], "distinct and ascending"),
        (2, [2, 2], "distinct and ascending"),
        (2, [1, 5], r"allowed 0\.\.4"),  # 5 = last layer of 6: its HF hidden state is post-norm
        (2, [-1, 2], r"allowed 0\.\.4"),
    ],
)
def test_bad_layer_ids_are_refused(n, ids, message):
    with pytest.raises(UserError, match=message):
        resolve_layer_ids(_cache_params(n, ids), 6)


def test_shard_plan_covers_rows_in_order():
    lengths = [5, 50, 30, 200, 7, 7, 7, 90, 1]
    plan = plan_shards(lengths, shard_tokens=100)
    assert [list(r) for r in plan] == [[0, 1, 2], [3], [4, 5, 6], [7, 8]]
    for r in plan:
        assert len(r) == 1 or sum(lengths[i] for i in r) <= 100


def test_batch_plan_respects_the_token_budget():
    lengths = [3, 17, 9, 9, 40, 1, 12, 25]
    batches = plan_batches(lengths, batch_tokens=36)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert lengths[b[0]] == max(lengths[i] for i in b)  # longest first: it sets the padded width
        assert len(b) == 1 or len(b) * lengths[b[0]] <= 36
    assert batches[0] == [4]  # 40 > 36 gets a batch alone
    assert plan_batches(lengths, 36) == batches  # deterministic


def test_cache_file_names():
    assert fmt.shard_name("val", 12) == "val-00012.safetensors"
    for name in ("train-00000.safetensors", "val-00003.safetensors.tmp", "manifest.json", "manifest.json.tmp"):
        assert fmt.is_cache_file(name), name
    for name in ("notes.txt", "test-00000.safetensors", "train-x.safetensors", "train-00000.bin"):
        assert not fmt.is_cache_file(name), name


def test_bytes_per_token():
    # features + int32 input_ids + uint8 loss_mask + int32 target_next
    assert fmt.bytes_per_token(5 * 576, "bfloat16") == 5 * 576 * 2 + 9
    assert fmt.bytes_per_token(64, "float32") == 64 * 4 + 9


@pytest.mark.parametrize("key", ["num_feature_layers", "batch_tokens", "shard_tokens", "max_val_conversations"])
def test_unusable_cache_params_are_refused(key):
    from dataclasses import replace

    from dominospec.cache.stage import check_params

    check_params(_cache_params(2))
    with pytest.raises(UserError, match=f"cache.{key} must be >= 1"):
        check_params(replace(_cache_params(2), **{key: 0}))
