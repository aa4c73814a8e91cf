"""The KV caches of a batch of conversations in slots, for any HF decoder-only target.

    keys / values per layer  [S, kv_heads, C, head_dim]   slot s holds its conversation's tokens
                                                           left-aligned in columns [0, lengths[s])
    lengths                  [S]                           tokens held per slot = its next RoPE position

No padding anywhere: a slot's new tokens are prefilled on their own (`prefill_slot`, batch 1, a
contiguous view of the slot) and a decoding step writes each slot's token at its own column
(`decode_all`). A conversation keeps its slot across turns, so earlier turns are never
recomputed; a reply cut short gives back its last tokens (`forget_last`); `keep` drops the slots
of finished conversations, so they stop costing compute. C grows in steps of GROW columns (up
to `limit`) and shrinks when slots are dropped.

Attention runs over all C columns of the buffer (the ones past a slot's length masked; the
buffer starts zeroed so they are never NaN): a prefix view [.., :T, ..] would not be contiguous,
and torch's CPU bmm copies such a view in full, once per layer and step, which cost more than the
attention itself. `grouped_attention` is registered with transformers' AttentionInterface as
`ATTENTION`; selecting it is an explicit switch (`grouped_attention_on(model)`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

ATTENTION = "dominospec_grouped"
GROW = 64  # C grows in steps of this many columns: decoding reads all C columns of every slot per step
# (memory-bound on this CPU), so C stays close to the longest slot; a growth copies the cache once


class SlotKV(Cache):
    """S slots of keys and values (see the module doc); an HF `Cache` for the model's forward."""

    def __init__(self, num_layers: int, slots: int, capacity: int = 256, limit: int | None = None):
        super().__init__(layers=[])
        self.num_layers, self.capacity, self.limit = num_layers, capacity, limit  # limit: C never grows past it
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [S, kv, C, d] each
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(slots, dtype=torch.long)  # [S]
        self._slot: int | None = None  # the slot being prefilled; None: a decoding step over all slots

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    def prefill_slot(self, slot: int, q: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of q new tokens of one slot -> (position_ids [1, q], additive mask [1, 1, q, C])."""
        start = int(self.lengths[slot])
        self._reserve(start + q)
        self._slot = slot
        positions = torch.arange(start, start + q)[None, :]  # [1, q]
        allowed = torch.arange(self.capacity)[None, :] <= positions[0, :, None]  # [q, C], causal
        return positions, _additive(allowed[None, None], dtype)

    def decode_all(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of one token per slot -> (position_ids [S, 1], additive mask [S, 1, 1, C])."""
        self._reserve(int(self.lengths.max()) + 1 if self.slots else 1)
        self._slot = None
        allowed = torch.arange(self.capacity)[None, :] <= self.lengths[:, None]  # [S, C]
        return self.lengths[:, None].clone(), _additive(allowed[:, None, None, :], dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """New keys/values [S or 1, kv, q, d] of one layer -> the keys/values to attend to [S or 1, kv, C, d]."""
        if self.keys[layer_idx] is None or self.keys[layer_idx].shape[2] != self.capacity:
            self._grow(layer_idx, key_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._slot is not None:  # prefill of one slot: [1, kv, q, d] at its next columns
            s, start, q = self._slot, int(self.lengths[self._slot]), key_states.shape[2]
            keys[s, :, start : start + q] = key_states[0]
            values[s, :, start : start + q] = value_states[0]
            return keys[s : s + 1], values[s : s + 1]  # contiguous views of the slot
        rows = torch.arange(self.slots)
        keys[rows, :, self.lengths] = key_states[:, :, 0]  # [S, kv, d] each at its slot's column
        values[rows, :, self.lengths] = value_states[:, :, 0]
        return keys, values

    def advance(self, slots: torch.Tensor, n: int) -> None:
        """After a forward: `slots` now hold their n new tokens."""
        self.lengths[slots] += n

    def forget_last(self, slot: int, n: int) -> None:
        """Drop slot's last n tokens (a reply cut short); the columns are overwritten later."""
        self.lengths[slot] -= n

    def clear(self, slot: int) -> None:
        """Empty a slot (its conversation starts afresh)."""
        self.lengths[slot] = 0

    def keep(self, slots: list[int]) -> None:
        """Keep only `slots`, renumbered 0.. in that order; C shrinks to what they hold."""
        index = torch.tensor(slots, dtype=torch.long)
        self.lengths = self.lengths[index]
        self.capacity = min(self.capacity, self._fit(int(self.lengths.max()) + 1 if len(slots) else 1))
        for store in (self.keys, self.values):
            for layer, buffer in enumerate(store):
                if buffer is not None:
                    store[layer] = buffer[:, :, : self.capacity].index_select(0, index)

    def _fit(self, columns: int) -> int:
        """Columns needed -> capacity: rounded up to GROW columns (and to at most `limit`, unless more are needed)."""
        rounded = -(-columns // GROW) * GROW
        return rounded if self.limit is None else max(columns, min(rounded, self.limit))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.slots else 0

    def _reserve(self, columns: int) -> None:
        if columns > self.capacity:
            self.capacity = self._fit(columns)  # the buffers follow at their next update

    def _grow(self, layer: int, like: torch.Tensor) -> None:
        _, heads, _, dim = like.shape
        for store in (self.keys, self.values):
            new = like.new_zeros(self.slots, heads, self.capacity, dim)  # zeros: masked columns are never NaN
            if store[layer] is not None:
                new[:, :, : store[layer].shape[2]] = store[layer]
            store[layer] = new


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> additive mask of 0 / -inf."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def grouped_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor, scaling: float, dropout: float = 0.0, **kwargs,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """query [R, H, q, d], key/value [R, kv, C, d], additive mask [R, 1, q, C] -> ([R, q, H, d], None).

    Decoding (q == 1) multiplies the G = H / kv query heads sharing a kv head as the rows of one
    batched matmul against the cached keys (no repeat of K/V); on this CPU it is several times
    faster than torch's flash kernel for one query. A prefill (q > 1) goes to
    scaled_dot_product_attention.
    """
    rows, heads, q, dim = query.shape
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    if q > 1:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=groups > 1
        )  # [R, H, q, d]
        return out.transpose(1, 2), None
    grouped = query.reshape(rows * kv_heads, groups, dim)  # [R*kv, G, d]
    mask = attention_mask.expand(rows, kv_heads, groups, columns).reshape(rows * kv_heads, groups, columns)
    keys_t = key.reshape(rows * kv_heads, columns, dim).transpose(1, 2)  # [R*kv, d, C]
    scores = torch.baddbmm(mask, grouped, keys_t, alpha=scaling)  # [R*kv, G, C]
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    out = torch.bmm(probs, value.reshape(rows * kv_heads, columns, dim))  # [R*kv, G, d]
    return out.reshape(rows, 1, heads, dim), None


AttentionInterface.register(ATTENTION, grouped_attention)


@contextmanager
def grouped_attention_on(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, `model` attends with `grouped_attention`; its own choice is restored after."""
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
