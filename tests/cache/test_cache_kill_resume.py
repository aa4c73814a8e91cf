"""Kill the real cache stage with SIGKILL mid-run, resume it, and compare with an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_helpers import REPO, save_regenerated, write_params

from dominospec import files
from dominospec.cache import format as fmt
from dominospec.cache.reader import CacheReader
from dominospec.cache.stage import cache
from dominospec.config import load_params

# ~5,000 tokens in ~25 shards: after the first shard the stage runs long enough (>1 s) to be killed mid-way.
SIZES = {"train": 180, "val": 12, "test": 2}
KNOBS = dict(num_feature_layers=3, layer_ids=None, max_train_conversations=None, max_val_conversations=None,
             batch_tokens=128, shard_tokens=200, dtype="bfloat16")


def _stage(params_path: Path, log: Path) -> subprocess.Popen:
    """Start `python pipeline/cache.py --params ...` from the repo root; output goes to `log`."""
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would stall the stage
        return subprocess.Popen(
            [sys.executable, "pipeline/cache.py", "--params", str(params_path)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )


def _listed_shards(root: Path) -> list[fmt.ShardInfo]:
    try:
        return fmt.read_manifest(root).shards
    except fmt.CacheError:  # not written yet
        return []


def _content(manifest: fmt.Manifest) -> list[tuple]:
    """The shards' identity without their timings."""
    return [(s.file, s.sequences, s.tokens, s.sha256) for s in manifest.shards]


def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path, tiny_targets, loaded_targets):
    identity = loaded_targets["llama"].identity.as_dict()
    runs = {}
    for name in ("killed", "clean"):
        save_regenerated(tmp_path / name / "regenerated", identity, SIZES, max_len=48, seed=3)
        runs[name] = write_params(tmp_path / name / "params.yaml", tiny_targets["llama"], tmp_path / name, **KNOBS)
    root = tmp_path / "killed" / "cache"

    log = tmp_path / "stage.log"
    proc = _stage(runs["killed"], log)
    deadline = time.monotonic() + 120
    while not _listed_shards(root):
        assert proc.poll() is None, f"stage ended before its first shard:\n{log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "no shard within 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL

    # What the killed run leaves: only complete, verified shards count; the split is not readable yet.
    manifest = fmt.read_manifest(root)
    listed = _listed_shards(root)
    assert 1 <= len(listed) and not manifest.complete
    for shard in listed:
        assert files.sha256_file(root / shard.file) == shard.sha256
    with pytest.raises(fmt.CacheError, match="incomplete"):
        CacheReader(root, "train" if not manifest.splits["train"].complete else "val")

    proc = _stage(runs["killed"], log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
    assert "resuming after" in log.read_text()
    resumed = json.loads((tmp_path / "killed" / "metrics" / "cache.json").read_text())
    assert 0 < resumed["computed_tokens"] < resumed["tokens"]  # it continued rather than starting again
    assert not list(root.glob("*.tmp"))

    cache(load_params(runs["clean"]))  # the reference: one uninterrupted run on the same data
    killed, clean = fmt.read_manifest(root), fmt.read_manifest(tmp_path / "clean" / "cache")
    assert killed.complete and _content(killed) == _content(clean)  # same files, sizes and sha256, in order
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in (tmp_path / "clean" / "cache").iterdir())
