"""Reading the cache: random access to one split by sequence index.

Shards are opened lazily with safetensors `safe_open` (memory-mapped) and only the rows of the
requested sequence are read. Each shard's sha256 is checked once: all at construction with
`verify=True`, else when the shard is first opened. The reader pickles without its open files,
so DataLoader workers reopen shards themselves and do not hash them again.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open

from dominospec import files
from dominospec.cache import format as fmt
from dominospec.target import TargetIdentity


class CacheReader:
    """One split of a complete cache: `reader[i]` -> sequence i as tensors, in source row order."""

    def __init__(self, root: Union[str, Path], split: str, verify: bool = True) -> None:
        """(cache dir, 'train' | 'val', verify all shards now?) -> reader. Raises CacheError when unusable."""
        self.root = Path(root)
        self.split = split
        self.manifest = fmt.read_manifest(self.root)
        if split not in self.manifest.splits:
            raise fmt.CacheError(f"{self.root}: no split '{split}' in the cache (has {sorted(self.manifest.splits)})")
        info = self.manifest.splits[split]
        if not info.complete:
            raise fmt.CacheError(
                f"{self.root}: split '{split}' is incomplete ({info.sequences} of {info.planned_sequences} "
                "sequences); re-run the cache stage to finish it"
            )
        self._shards = info.shards
        self._starts = [0]  # _starts[k] = index of shard k's first sequence; _starts[-1] = len(self)
        for shard in self._shards:
            self._starts.append(self._starts[-1] + shard.sequences)
            if not (self.root / shard.file).is_file():
                raise fmt.CacheError(f"{self.root / shard.file}: shard listed in the manifest is missing")
        self._verified: set[int] = set()
        self._open_shards: dict[int, tuple[Any, torch.Tensor]] = {}  # k -> (safe_open handle, offsets [S+1])
        if verify:
            for k in range(len(self._shards)):
                self._verify(k)

    def __len__(self) -> int:
        return self._starts[-1]

    def lengths(self) -> list[int]:
        """Tokens of each sequence [len(self)], from the shards' offsets (no features read)."""
        return [n for k in range(len(self._shards)) for n in self._open(k)[1].diff().tolist()]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Sequence index -> {'input_ids' [T] int64, 'loss_mask' [T] bool, 'target_next' [T] int64,
        'target_hidden' [T, n*H] cache dtype}."""
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} in split '{self.split}'")
        k = bisect.bisect_right(self._starts, index) - 1
        handle, offsets = self._open(k)
        local = index - self._starts[k]
        a, b = int(offsets[local]), int(offsets[local + 1])
        return {
            "input_ids": handle.get_slice(fmt.INPUT_IDS)[a:b].long(),
            "loss_mask": handle.get_slice(fmt.LOSS_MASK)[a:b].bool(),
            "target_next": handle.get_slice(fmt.TARGET_NEXT)[a:b].long(),
            # the slice is a view of the shared file mapping: copy, so a caller's in-place op stays its own
            "target_hidden": handle.get_slice(fmt.TARGET_HIDDEN)[a:b].clone(),
        }

    def check_target(self, identity: Union[TargetIdentity, dict[str, Any]]) -> None:
        """Raise CacheError unless the cache was made from the same target weights as `identity`."""
        if isinstance(identity, dict):
            identity = TargetIdentity(**identity)
        made_from = self.manifest.target
        if not identity.same_model(made_from):
            raise fmt.CacheError(
                f"{self.root}: cache made from target {made_from.get('name')!r} "
                f"(sha256 {str(made_from.get('sha256'))[:12]}), not {identity.name!r} "
                f"(sha256 {str(identity.sha256)[:12]}); re-run the cache stage for this target"
            )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open_shards"] = {}  # file handles do not pickle; reopened on first use
        return state

    def _verify(self, k: int) -> None:
        if k in self._verified:
            return
        shard = self._shards[k]
        path = self.root / shard.file
        try:
            digest = files.sha256_file(path)
        except FileNotFoundError:
            raise fmt.CacheError(f"{path}: shard listed in the manifest is missing") from None
        if digest != shard.sha256:
            raise fmt.CacheError(f"{path}: shard is corrupt (sha256 differs from the manifest); re-run the cache stage")
        self._verified.add(k)

    def _open(self, k: int) -> tuple[Any, torch.Tensor]:
        if k in self._open_shards:
            return self._open_shards[k]
        self._verify(k)
        shard, path, m = self._shards[k], self.root / self._shards[k].file, self.manifest
        handle = safe_open(str(path), framework="pt", device="cpu")
        expected = {
            fmt.INPUT_IDS: ([shard.tokens], "I32"),
            fmt.LOSS_MASK: ([shard.tokens], "U8"),
            fmt.TARGET_NEXT: ([shard.tokens], "I32"),
            fmt.TARGET_HIDDEN: ([shard.tokens, m.feature_dim], fmt.SAFETENSORS_DTYPES[m.dtype]),
            fmt.OFFSETS: ([shard.sequences + 1], "I64"),
        }
        if set(handle.keys()) != set(expected):
            raise fmt.CacheError(f"{path}: shard holds tensors {sorted(handle.keys())}, expected {sorted(expected)}")
        for name, (shape, dtype) in expected.items():
            got = handle.get_slice(name)
            if list(got.get_shape()) != shape or got.get_dtype() != dtype:
                raise fmt.CacheError(
                    f"{path}: tensor '{name}' is {got.get_dtype()} {got.get_shape()}, expected {dtype} {shape}"
                )
        offsets = handle.get_tensor(fmt.OFFSETS)  # [S+1]
        if int(offsets[0]) != 0 or int(offsets[-1]) != shard.tokens or bool((offsets[1:] <= offsets[:-1]).any()):
            raise fmt.CacheError(f"{path}: offsets do not cut {shard.tokens} tokens into {shard.sequences} sequences")
        self._open_shards[k] = (handle, offsets)
        return handle, offsets
