"""Write -> read round trip on tiny Llama and Qwen3 targets: features equal a direct HF forward."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from cache_helpers import save_regenerated, write_params

from dominospec.cache import format as fmt
from dominospec.cache.reader import CacheReader
from dominospec.cache.stage import cache
from dominospec.config import load_params
from dominospec.target import default_layer_ids

SIZES = {"train": 23, "val": 6, "test": 4}


def _reference(target, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded sequence [T] -> (cat of HF hidden_states[l+1] over layer_ids [T, n*H] float32,
    the logits [T, V])."""
    with torch.inference_mode():
        out = target.model(input_ids=input_ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[l + 1][0] for l in layer_ids], dim=-1), out.logits[0]


@pytest.mark.parametrize(
    "arch, dtype, n",
    [("llama", "bfloat16", 3), ("qwen3", "float32", 2)],
)
def test_round_trip_equals_direct_forward(tmp_path, tiny_targets, loaded_targets, arch, dtype, n):
    import datasets

    target = loaded_targets[arch]
    data_dir = save_regenerated(tmp_path / "regenerated", target.identity.as_dict(), SIZES)
    params = load_params(write_params(
        tmp_path / "params.yaml", tiny_targets[arch], tmp_path,
        num_feature_layers=n, layer_ids=None, max_train_conversations=20, max_val_conversations=None,
        batch_tokens=96, shard_tokens=200, dtype=dtype, compute_dtype=None,
    ))
    cache(params)

    layer_ids = default_layer_ids(target.num_layers, n)
    source = datasets.load_from_disk(str(data_dir))
    for split, expected_rows in (("train", 20), ("val", SIZES["val"])):
        reader = CacheReader(params.paths.cache, split)
        reader.check_target(target.identity)
        assert len(reader) == expected_rows
        assert reader.manifest.layer_ids == tuple(layer_ids)
        assert reader.manifest.feature_dim == n * target.hidden_size
        if split == "train":  # several shards, several padded batches each
            assert len(reader.manifest.splits[split].shards) > 2
        for i in range(len(reader)):
            item = reader[i]
            row = source[split][i]
            assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == row["input_ids"]
            assert item["loss_mask"].dtype == torch.bool and item["loss_mask"].tolist() == [bool(m) for m in row["loss_mask"]]
            assert item["target_hidden"].dtype == fmt.DTYPES[dtype]
            ref, logits = _reference(target, item["input_ids"], layer_ids)
            # the target's greedy next token: its argmax, unless padding's rounding flips a near-tie
            top2 = logits.topk(2, dim=-1).values
            decided = (top2[:, 0] - top2[:, 1]) > 1e-4
            assert item["target_next"].dtype == torch.int64 and decided.float().mean() > 0.9
            assert torch.equal(item["target_next"][decided], logits.argmax(-1)[decided])
            assert item["target_hidden"].shape == ref.shape
            if dtype == "float32":  # padding and batching change only float rounding
                torch.testing.assert_close(item["target_hidden"], ref, rtol=1e-5, atol=1e-5)
            else:  # bf16 keeps 8 mantissa bits: round-to-nearest is within half an ulp = 2^-9 relative
                torch.testing.assert_close(item["target_hidden"].float(), ref, rtol=2**-8, atol=1e-6)
                # and almost every element is exactly the reference rounded (others sit on a rounding edge)
                rounded = ref.to(torch.bfloat16)
                assert (item["target_hidden"] != rounded).float().mean() < 0.01

    metrics = json.loads((tmp_path / "metrics" / "cache.json").read_text())
    tokens = sum(len(source["train"][i]["input_ids"]) for i in range(20)) + sum(source["val"]["num_tokens"])
    assert metrics["tokens"] == metrics["computed_tokens"] == tokens
    assert metrics["tokens_per_s"] > 0 and metrics["shard_seconds"] <= metrics["seconds"]
    assert metrics["splits"]["train"]["sequences"] == 20 and metrics["splits"]["val"]["sequences"] == SIZES["val"]
    assert metrics["layer_ids"] == layer_ids
    assert metrics["bytes_per_token"] == n * target.hidden_size * fmt.DTYPES[dtype].itemsize + 9
    shard_files = sorted(p.name for p in (tmp_path / "cache").glob("*.safetensors"))
    assert metrics["shards"] == len(shard_files)
    assert metrics["disk_bytes"] == sum((tmp_path / "cache" / f).stat().st_size for f in shard_files + ["manifest.json"])
    assert metrics["target"] == target.identity.as_dict()


def test_features_differ_between_layers(loaded_targets):
    # The round trip above can only catch a wrong layer if neighbouring layers differ by more than its tolerance.
    target = loaded_targets["llama"]
    ids = torch.arange(3, 40)
    h, _ = _reference(target, ids, [1, 2])
    a, b = h[:, :32], h[:, 32:]
    assert ((a - b).abs() > 2**-8 * a.abs() + 1e-3).float().mean() > 0.5


def test_rerun_continues_and_changed_params_or_code_start_afresh(tmp_path, tiny_targets, loaded_targets, monkeypatch):
    from dominospec import files

    target = loaded_targets["llama"]
    save_regenerated(tmp_path / "regenerated", target.identity.as_dict(), SIZES)
    knobs = dict(num_feature_layers=2, layer_ids=None, max_train_conversations=None, max_val_conversations=None,
                 batch_tokens=128, shard_tokens=150, dtype="bfloat16")
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **knobs))
    cache(params)
    first = fmt.read_manifest(params.paths.cache)
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*.safetensors")}

    cache(params)  # complete and unchanged: nothing recomputed, nothing rewritten
    assert fmt.read_manifest(params.paths.cache) == first
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*.safetensors")} == mtimes
    noop = json.loads((tmp_path / "metrics" / "cache.json").read_text())
    assert noop["computed_tokens"] == 0 and noop["tokens"] > 0
    assert noop["tokens_per_s"] == round(noop["tokens"] / sum(s.seconds for s in first.shards), 1)  # from the build

    (tmp_path / "cache" / "notes.txt").write_text("not ours")
    changed = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path,
                                       **{**knobs, "layer_ids": [0, 3]}))
    cache(changed)
    second = fmt.read_manifest(changed.paths.cache)
    assert second.fingerprint != first.fingerprint and second.layer_ids == (0, 3) and second.complete
    metrics = json.loads((tmp_path / "metrics" / "cache.json").read_text())
    assert metrics["computed_tokens"] == metrics["tokens"]
    listed = {s.file for info in second.splits.values() for s in info.shards}
    assert {p.name for p in (tmp_path / "cache").glob("*.safetensors")} == listed
    assert (tmp_path / "cache" / "notes.txt").exists()  # files that are not the cache's are left alone

    # the manifest's fingerprint holds the code digest: under other code no shard is reused
    monkeypatch.setattr(files, "code_digest", lambda: "other code")
    cache(changed)
    third = fmt.read_manifest(changed.paths.cache)
    assert third.fingerprint != second.fingerprint and third.complete
    metrics = json.loads((tmp_path / "metrics" / "cache.json").read_text())
    assert metrics["computed_tokens"] == metrics["tokens"] > 0


def test_other_rows_under_the_same_meta_are_another_cache(tmp_path, tiny_targets, loaded_targets):
    """meta.json does not name the replies: a regenerate run with another batch size writes the same meta
    and (in bf16) other tokens. The cache must recompute, and its fingerprint (what a resumed train
    stage compares) must change; the same rows give the same fingerprint."""
    target = loaded_targets["llama"]
    knobs = dict(num_feature_layers=2, layer_ids=None, max_train_conversations=None, max_val_conversations=None,
                 batch_tokens=128, shard_tokens=150, dtype="bfloat16")
    params = load_params(write_params(tmp_path / "params.yaml", tiny_targets["llama"], tmp_path, **knobs))
    save_regenerated(tmp_path / "regenerated", target.identity.as_dict(), SIZES, seed=0)
    meta = (tmp_path / "regenerated" / "meta.json").read_bytes()
    cache(params)
    first = fmt.read_manifest(params.paths.cache)

    save_regenerated(tmp_path / "regenerated", target.identity.as_dict(), SIZES, seed=0)  # the same rows again
    cache(params)
    assert fmt.read_manifest(params.paths.cache).fingerprint == first.fingerprint
    assert json.loads((tmp_path / "metrics" / "cache.json").read_text())["computed_tokens"] == 0

    save_regenerated(tmp_path / "regenerated", target.identity.as_dict(), SIZES, seed=1)  # other tokens
    assert (tmp_path / "regenerated" / "meta.json").read_bytes() == meta
    cache(params)
    second = fmt.read_manifest(params.paths.cache)
    assert second.fingerprint != first.fingerprint and second.complete
    metrics = json.loads((tmp_path / "metrics" / "cache.json").read_text())
    assert metrics["computed_tokens"] == metrics["tokens"]


def test_a_bf16_target_forward_is_a_cache_of_its_own(tmp_path, tiny_targets, loaded_targets):
    """cache.compute_dtype: bfloat16 -> the features come from the target cast to bf16: close to the
    float32 target's (bf16 rounding through two layers), not equal to them, recorded in cache.json,
    and under another fingerprint, so a train run on the fp32 cache does not resume on this one."""
    target = loaded_targets["llama"]
    save_regenerated(tmp_path / "regenerated", target.identity.as_dict(), SIZES)
    readers = {}
    for compute in ("float32", "bfloat16"):
        root = tmp_path / compute
        root.mkdir()
        params = load_params(write_params(
            root / "params.yaml", tiny_targets["llama"], root, num_feature_layers=3, layer_ids=None,
            max_train_conversations=8, max_val_conversations=None, batch_tokens=96, shard_tokens=200,
            dtype="float32", compute_dtype=compute,
        ))
        params = dataclasses.replace(params, paths=dataclasses.replace(params.paths, regenerated=str(tmp_path / "regenerated")))
        cache(params)
        readers[compute] = CacheReader(params.paths.cache, "train")
        assert json.loads((root / "metrics" / "cache.json").read_text())["compute_dtype"] == compute
    full, half = readers["float32"], readers["bfloat16"]
    assert full.manifest.fingerprint != half.manifest.fingerprint
    errors = []
    for i in range(len(full)):
        a, b = full[i]["target_hidden"], half[i]["target_hidden"]
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        errors.append(((a - b).norm() / a.norm()).item())
    assert 0 < max(errors) < 0.05  # bf16 arithmetic (8 mantissa bits) through a 2-layer target
