"""transformers' KV cache, the same on every release: its forward's keyword, its length, crop and tensors.

`DynamicCache.crop(x)` changed meaning across releases (older: x >= 0 the length to keep, x < 0 rows
to drop; newer: only x <= 0, rows to drop), so `crop_kv` only ever passes a negative count.
"""

from __future__ import annotations

from typing import Any


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


def layer_tensors(cache: Any) -> list[Any]:
    """Every layer's key and value tensors: `cache.layers[i].keys / .values` (transformers >= 4.54),
    else the older `key_cache` / `value_cache` lists."""
    if getattr(cache, "layers", None):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return list(cache.key_cache) + list(cache.value_cache)
