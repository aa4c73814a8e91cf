"""The target hidden-state cache format, defined once for the writer and the reader.

A cache is a directory holding `manifest.json` and safetensors shards, one split at a time:

    data/cache/manifest.json
    data/cache/train-00000.safetensors   train-00001.safetensors ...   val-00000.safetensors

A shard holds a run of whole sequences, concatenated along the token axis (N tokens, S sequences):

    input_ids      [N]       int32    target token ids
    loss_mask      [N]       uint8    1 = supervised (assistant) token
    target_next    [N]       int32    the target's greedy token after x[..t] (argmax of its logits at t)
    target_hidden  [N, n*H]  <dtype>  outputs of the n target layers `layer_ids`, concatenated in
                                      layer order; layer l = HF hidden_states[l+1] (raw residual stream)
    offsets        [S+1]     int64    sequence s is rows offsets[s]:offsets[s+1]; offsets[0] = 0, offsets[S] = N

Sequence i of a split is row i of the source split (dataset order); shard k holds the rows that follow
those of shard k-1. A shard counts only once the manifest lists it with its sha256; shards are written
under a temporary name and renamed, then the manifest is replaced atomically, so a killed writer never
leaves a partial shard that counts. A re-run reuses shards when the manifest header (format version,
target, layers, dtype, data fingerprint) matches. The fingerprint includes the installed code's
digest (files.code_digest), so shards written by other code are recomputed, never continued;
FORMAT_VERSION names the file layout this code reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from dominospec.errors import UserError
from dominospec.files import TEMP_SUFFIX, write_atomic

FORMAT_VERSION = 3  # bump whenever a shard or the manifest changes shape or meaning (2: shard seconds, 3: target_next)
MANIFEST_NAME = "manifest.json"
SHARD_SUFFIX = ".safetensors"
SPLITS = ("train", "val")

# tensor names inside a shard
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
TARGET_NEXT = "target_next"
TARGET_HIDDEN = "target_hidden"
OFFSETS = "offsets"

# cache dtype name -> torch dtype; bytes per feature element follow from the torch dtype
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # as safe_open reports them
ID_BYTES = 4 + 1 + 4  # int32 input_ids + uint8 loss_mask + int32 target_next, per token


class CacheError(UserError):
    """A cache that cannot be used: missing, corrupt, incomplete, another version or another target."""


@dataclass(frozen=True)
class ShardInfo:
    """One complete shard as listed in the manifest."""

    file: str  # file name inside the cache directory
    sequences: int
    tokens: int
    sha256: str
    seconds: float  # time spent computing and writing it (provenance for throughput; not content)


@dataclass(frozen=True)
class SplitInfo:
    """What a split will hold once complete, and the shards written so far (in order)."""

    planned_sequences: int
    planned_tokens: int
    shards: tuple[ShardInfo, ...] = ()

    @property
    def sequences(self) -> int:
        return sum(s.sequences for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def complete(self) -> bool:
        return self.sequences == self.planned_sequences


@dataclass(frozen=True)
class Manifest:
    """The contents of `manifest.json`: what the cache was made from and which shards count."""

    format_version: int
    target: dict[str, Any]  # TargetIdentity.as_dict() of the target that produced the features
    layer_ids: tuple[int, ...]  # 0-based decoder layers; layer l = hidden_states[l+1]
    hidden_size: int  # H
    feature_dim: int  # n*H, the width of target_hidden
    dtype: str  # key of DTYPES
    mask_token_id: int
    fingerprint: str  # data_fingerprint(...) of the inputs; another value means another cache
    splits: dict[str, SplitInfo]

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.feature_dim, self.dtype)

    @property
    def complete(self) -> bool:
        return all(info.complete for info in self.splits.values())

    @property
    def shards(self) -> list[ShardInfo]:
        """All shards, split by split in SPLITS order."""
        return [s for info in self.splits.values() for s in info.shards]

    def with_shard(self, split: str, shard: ShardInfo) -> "Manifest":
        """-> a copy with `shard` appended to `split`."""
        info = self.splits[split]
        splits = {**self.splits, split: dataclasses.replace(info, shards=info.shards + (shard,))}
        return dataclasses.replace(self, splits=splits)

    def with_shards(self, split: str, shards: Iterable[ShardInfo]) -> "Manifest":
        """-> a copy whose `split` lists exactly `shards`."""
        info = dataclasses.replace(self.splits[split], shards=tuple(shards))
        return dataclasses.replace(self, splits={**self.splits, split: info})


def bytes_per_token(feature_dim: int, dtype: str) -> int:
    """(n*H, cache dtype) -> bytes one cached token takes in a shard (features + id + mask)."""
    return feature_dim * DTYPES[dtype].itemsize + ID_BYTES


def shard_name(split: str, index: int) -> str:
    """('train', 3) -> 'train-00003.safetensors'."""
    return f"{split}-{index:05d}{SHARD_SUFFIX}"


def is_cache_file(name: str) -> bool:
    """True for the names this format writes: shards, the manifest, and their temporary names."""
    name = name.removesuffix(TEMP_SUFFIX)
    if name == MANIFEST_NAME:
        return True
    stem = name.removesuffix(SHARD_SUFFIX)
    split, _, index = stem.rpartition("-")
    return name.endswith(SHARD_SUFFIX) and split in SPLITS and index.isdigit()


def data_fingerprint(meta_json: bytes, split_sizes: dict[str, int], content: dict[str, Any]) -> str:
    """(meta.json bytes, rows per source split, cache settings that change the content) -> sha256 hex."""
    h = hashlib.sha256()
    h.update(hashlib.sha256(meta_json).digest())
    h.update(json.dumps({"split_sizes": split_sizes, "content": content}, sort_keys=True).encode())
    return h.hexdigest()


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Manifest -> `root/manifest.json`, atomically."""
    raw = dataclasses.asdict(manifest)
    raw["layer_ids"] = list(manifest.layer_ids)
    write_atomic(Path(root) / MANIFEST_NAME, (json.dumps(raw, indent=2) + "\n").encode())


def read_manifest(root: Path) -> Manifest:
    """`root/manifest.json` -> Manifest. Raises CacheError when missing, unreadable or of another version."""
    path = Path(root) / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CacheError(f"{path}: no cache manifest (run the cache stage)") from None
    except (OSError, ValueError) as err:
        raise CacheError(f"{path}: unreadable cache manifest: {err}") from None
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise CacheError(
            f"{path}: cache format version {version!r}, this code reads version {FORMAT_VERSION}; "
            "re-run the cache stage to rebuild it"
        )
    try:
        splits = {
            name: SplitInfo(
                planned_sequences=int(s["planned_sequences"]),
                planned_tokens=int(s["planned_tokens"]),
                shards=tuple(ShardInfo(**shard) for shard in s["shards"]),
            )
            for name, s in raw["splits"].items()
        }
        return Manifest(
            format_version=version,
            target=dict(raw["target"]),
            layer_ids=tuple(int(i) for i in raw["layer_ids"]),
            hidden_size=int(raw["hidden_size"]),
            feature_dim=int(raw["feature_dim"]),
            dtype=str(raw["dtype"]),
            mask_token_id=int(raw["mask_token_id"]),
            fingerprint=str(raw["fingerprint"]),
            splits=splits,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CacheError(f"{path}: malformed cache manifest ({type(err).__name__}: {err})") from None


def shard_tensors(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, target_hidden: torch.Tensor, offsets: torch.Tensor,
    target_next: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The five shard tensors, checked and converted to their stored dtypes -> {name: tensor}."""
    n = input_ids.shape[0]
    if loss_mask.shape != (n,) or target_next.shape != (n,) or target_hidden.shape[0] != n or target_hidden.ndim != 2:
        raise ValueError(f"shard shapes disagree: {input_ids.shape}, {loss_mask.shape}, {target_next.shape}, "
                         f"{target_hidden.shape}")
    if offsets[0] != 0 or offsets[-1] != n:
        raise ValueError(f"offsets must run from 0 to {n}, got {offsets[0]}..{offsets[-1]}")
    return {
        INPUT_IDS: input_ids.to(torch.int32).contiguous(),
        LOSS_MASK: loss_mask.to(torch.uint8).contiguous(),
        TARGET_NEXT: target_next.to(torch.int32).contiguous(),
        TARGET_HIDDEN: target_hidden.contiguous(),
        OFFSETS: offsets.to(torch.int64).contiguous(),
    }
