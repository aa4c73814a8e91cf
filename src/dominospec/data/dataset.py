"""The on-disk conversation dataset shared by prepare, regenerate, cache and evaluate (format version 1).

A directory holding a `datasets.DatasetDict` (`save_to_disk`) with splits train/val/test, one row
per conversation:

    id          str
    messages    list of {role, content}   normalised (system | user | assistant)
    input_ids   list of int32             [T] chat-template rendering, T <= max_length
    loss_mask   list of int8              [T] 1 on assistant content and its closing token
    num_tokens  int32                     T

and next to it `meta.json`: {"format_version": 1, "target": TargetIdentity.as_dict(),
"mask_token_id": int, "max_length": int, "source": str} (+ "regenerated": int after regenerate).

Writers build the whole directory under a temporary sibling name and rename it into place, so
the output path holds either the previous complete dataset or the new one, never half of one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, Features, List, Value, load_from_disk

from dominospec.errors import UserError
from dominospec.data.conversations import SPLITS
from dominospec.files import replace_path, temp_sibling

FORMAT_VERSION = 1
META_FILE = "meta.json"
META_KEYS = ("format_version", "target", "mask_token_id", "max_length", "source")
FEATURES = Features(
    {
        "id": Value("string"),
        "messages": List({"role": Value("string"), "content": Value("string")}),
        "input_ids": List(Value("int32")),
        "loss_mask": List(Value("int8")),
        "num_tokens": Value("int32"),
    }
)


def empty_split() -> Dataset:
    """A split with no rows and the dataset's columns."""
    return Dataset.from_dict({name: [] for name in FEATURES}, features=FEATURES)


def write_dataset(out_dir: str | Path, splits: DatasetDict, meta: dict[str, Any]) -> None:
    """(splits train/val/test with FEATURES' columns, meta) -> `out_dir`, replaced atomically."""
    if set(splits) != set(SPLITS):
        raise ValueError(f"a conversation dataset has splits {list(SPLITS)}, got {sorted(splits)}")
    for name, split in splits.items():
        if split.features != FEATURES:
            raise ValueError(f"split {name}: columns {split.features} differ from the dataset format")
    missing = [k for k in META_KEYS if k not in meta]
    if missing or meta["format_version"] != FORMAT_VERSION:
        raise ValueError(f"meta.json needs {list(META_KEYS)} with format_version {FORMAT_VERSION}; got {meta}")
    out_dir = Path(out_dir)
    tmp = temp_sibling(out_dir)
    # An empty split needs one explicit (empty) shard: with zero shards it cannot be loaded back.
    num_shards = {name: 1 for name in SPLITS if len(splits[name]) == 0}
    DatasetDict({name: splits[name] for name in SPLITS}).save_to_disk(str(tmp), num_shards=num_shards)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    replace_path(tmp, out_dir)


def read_dataset(path: str | Path) -> tuple[DatasetDict, dict[str, Any]]:
    """A dataset directory -> (DatasetDict train/val/test, meta); UserError when missing or of another format."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise UserError(f"{path}: no conversation dataset here ({META_FILE} missing): run the prepare stage first")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{meta_path}: format_version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}: "
            "re-run the prepare stage"
        )
    splits = load_from_disk(str(path))
    if not isinstance(splits, DatasetDict) or set(splits) != set(SPLITS):
        raise UserError(f"{path}: expected splits {list(SPLITS)}")
    return splits, meta
