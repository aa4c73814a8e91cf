"""The target's KV cache: length and crop, the same on every transformers release.

`DynamicCache.crop(x)` changed meaning across releases (older: x >= 0 the length to keep, x < 0 rows
to drop; newer: only x <= 0, rows to drop), so `crop_kv` only ever passes a negative count. `move_rows`
copies cached rows into earlier slots in place (a fork's or a tree's winning path), on either cache.
"""

from __future__ import annotations

from typing import Any

import torch


def kv_length(cache: Any) -> int:
    """Cache -> number of cached positions (rows per layer)."""
    return int(cache.get_seq_length())


def crop_kv(cache: Any, length: int) -> None:
    """Drop cached rows beyond `length` (keep positions 0..length-1); checks the result."""
    current = kv_length(cache)
    if length > current:
        raise ValueError(f"cannot crop a KV cache of {current} rows to {length}")
    if length < current:
        cache.crop(length - current)  # negative: rows to drop (version-proof)
    if kv_length(cache) != length:
        raise RuntimeError(f"KV cache crop to {length} rows left {kv_length(cache)}: cache type not croppable")


def cache_argument(model: Any) -> str:
    """Name of the KV-cache keyword of `model.forward`: `cache` (transformers >= 5.2x) or `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def move_rows(tensors: list[torch.Tensor], start: int, rows: list[int]) -> None:
    """Rows start + rows[i] -> start + i along dim 2, for i in order, in every cache tensor [.., .., rows, D]
    (a fork's or a tree's winning path into place; rows ascending, rows[i] >= i). The caller crops after."""
    if rows == list(range(len(rows))):
        return
    source = torch.tensor([start + r for r in rows], device=tensors[0].device)
    for tensor in tensors:
        tensor[:, :, start:start + len(rows)] = tensor.index_select(2, source)


def layer_tensors(cache: Any) -> list[Any]:
    """Every layer's key and value tensors: `cache.layers[i].keys / .values` (transformers >= 4.54),
    else the older `key_cache` / `value_cache` lists."""
    if getattr(cache, "layers", None):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return list(cache.key_cache) + list(cache.value_cache)
