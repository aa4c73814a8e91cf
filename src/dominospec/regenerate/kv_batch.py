"""The KV caches of a batch of conversations in slots, for any HF decoder-only target.

    lengths                  [S]                     tokens held per slot = its next RoPE position
    groups                   slots g*n .. g*n+n-1    n = `group_slots` consecutive slots
    keys / values per layer  one buffer per group    [n_g, kv_heads, C_g, head_dim]; slot s holds its
                                                     conversation's tokens left-aligned in columns
                                                     [0, lengths[s]) of row s - g*n of its group

No padding anywhere: empty slots' first tokens are prefilled together as one packed sequence
(`prefill_packed`: block-diagonal causal mask, positions restarting per slot, each segment's K/V
written to its slot), a slot that already holds tokens prefills its new ones on its own
(`prefill_slot`, batch 1, a contiguous view of the slot's row), and a decoding step writes each
slot's token at its own column (`decode_all`). A conversation keeps its slot across turns, so earlier turns are never
recomputed; a reply cut short gives back its last tokens (`forget_last`); `keep` drops the slots
of finished conversations, so they stop costing compute. Each group's C_g grows in steps of GROW
columns (up to `limit`) and shrinks when slots are dropped.

Why groups. Decoding reads every column of a buffer (memory-bound on the CPU), and a prefix view
[.., :T, ..] would not help: it is not contiguous, and torch's CPU bmm copies such a view in full
once per layer and step, which costs more than the attention itself. Slots of a chunk start
together and grow together, and the stage hands them out in order of prompt length, so
neighbouring slots have similar lengths: a group's C_g stays close to its own longest slot
instead of the batch's. On the default chunk this reads 0.4 of the columns of one shared buffer.
GROUP_SLOTS and the stage's batch size were chosen together on the 2-core CPU: 256 slots in
groups of 32 regenerate more tokens/s than 64 in groups of 16 (the numbers are in
docs/journal/2026-12-02-the-regenerate-stage-at-256-slots-in-kv-groups-of-32.md).

The buffers are made like the K/V the model passes in (its device and dtype); the masks, positions
and write indices are built on `device`, the model's, so a forward copies nothing from the host. On
a GPU a group's ops cost kernel launches rather than columns read, so groups are wider there
(GROUP_SLOTS_CUDA).

Attention over the groups is `grouped_attention`, registered with transformers'
AttentionInterface as `ATTENTION`; `grouped_attention_on(model, kv)` selects it for the model and
makes `kv` the cache it reads while decoding (the layer's new K/V are already in the group buffers,
so the tensors HF passes in are not used then).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from dominospec.runtime.attention import gqa_one_query, gqa_sdpa

ATTENTION = "dominospec_grouped"
GROW = 64  # C_g grows in steps of this many columns; a growth copies that group's buffer once
GROUP_SLOTS = 32  # slots per group: eight groups at the default 256 slots (each group costs its own attention ops)
GROUP_SLOTS_CUDA = 1024  # on a GPU a group's ops cost launches, not columns read: one group at the preset's 1,024 slots (faster than 8 groups on an H200; journal)
_DECODING: ContextVar[Optional["SlotKV"]] = ContextVar("dominospec_slot_kv", default=None)


class SlotKV(Cache):
    """S slots of keys and values in groups (see the module doc); an HF `Cache` for the model's forward."""

    def __init__(self, num_layers: int, slots: int, capacity: int = 256, limit: int | None = None,
                 group_slots: int | None = None, device: torch.device | str = "cpu"):  # fmt: skip
        super().__init__(layers=[])
        self.num_layers, self.limit = num_layers, limit  # limit: C_g never grows past it
        self.device = torch.device(device)  # the model's: the decoding masks the attention reads live there
        self.group_slots = group_slots or (GROUP_SLOTS_CUDA if self.device.type == "cuda" else GROUP_SLOTS)
        self.lengths = torch.zeros(slots, dtype=torch.long)  # [S]
        self.capacities = [capacity] * self.num_groups  # C_g per group
        self.keys: list[list[torch.Tensor | None]] = [[None] * self.num_groups for _ in range(num_layers)]
        self.values: list[list[torch.Tensor | None]] = [[None] * self.num_groups for _ in range(num_layers)]
        self._slot: int | None = None  # the slot being prefilled alone
        self._pack: tuple[list[int], list[int]] | None = None  # (slots, lengths) of a packed prefill
        self._masks: list[torch.Tensor] = []  # decoding: per group additive mask [n_g, 1, 1, C_g]
        self._columns: list[torch.Tensor] = []  # decoding: per group the column each slot writes [n_g], on `device`
        self._rows: dict[int, torch.Tensor] = {}  # n_g -> arange(n_g) on `device` (index tensors made once, not per layer)

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_groups(self) -> int:
        return -(-self.slots // self.group_slots)

    @property
    def decoding(self) -> bool:
        """The forward being set up is a decoding step over all slots (not a prefill)."""
        return self._slot is None and self._pack is None

    @property
    def capacity(self) -> int:
        """The widest group's C_g (the width of the decoding mask HF is given)."""
        return max(self.capacities, default=0)

    def group_range(self, g: int) -> tuple[int, int]:
        """Group g -> its slots [first, end)."""
        return g * self.group_slots, min(self.slots, (g + 1) * self.group_slots)

    def prefill_slot(self, slot: int, q: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of q new tokens of one slot -> (position_ids [1, q], additive mask [1, 1, q, C_g])."""
        start, g = int(self.lengths[slot]), slot // self.group_slots
        self._reserve(g, start + q)
        self._slot, self._pack = slot, None
        positions = torch.arange(start, start + q, device=self.device)[None, :]  # [1, q]
        allowed = torch.arange(self.capacities[g], device=self.device)[None, :] <= positions[0, :, None]  # [q, C_g], causal
        return positions, _additive(allowed[None, None], dtype)

    def prefill_packed(self, slots: list[int], lengths: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up one forward of the first lengths[i] tokens of each empty slot slots[i], packed into one
        sequence of Q = sum(lengths) -> (position_ids [1, Q], additive mask [1, 1, Q, Q]: causal within a slot)."""
        assert all(int(self.lengths[s]) == 0 for s in slots), "a packed prefill starts empty slots only"
        for s, n in zip(slots, lengths):
            self._reserve(s // self.group_slots, n)
        self._slot, self._pack = None, (list(slots), list(lengths))
        counts = torch.tensor(lengths, device=self.device)
        segment = torch.repeat_interleave(torch.arange(len(lengths), device=self.device), counts)  # [Q]
        columns = torch.arange(segment.numel(), device=self.device)
        positions = (columns - (counts.cumsum(0) - counts)[segment])[None, :]  # [1, Q]: 0.. within each slot
        allowed = (segment[:, None] == segment[None, :]) & (columns[None, :] <= columns[:, None])  # [Q, Q]
        return positions, _additive(allowed[None, None], dtype)

    def decode_all(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Set up a forward of one token per slot -> (position_ids [S, 1], additive mask [S, 1, 1, C]).
        The attention reads each group's own mask [n_g, 1, 1, C_g]; the [S, .., C] one is what HF is given."""
        self._slot, self._pack = None, None
        self._masks, self._columns = [], []
        lengths = self.lengths.to(self.device)  # one copy a step: every layer's writes index with it
        for g in range(self.num_groups):
            first, end = self.group_range(g)
            self._reserve(g, int(self.lengths[first:end].max()) + 1)
            allowed = torch.arange(self.capacities[g], device=self.device)[None, :] <= lengths[first:end, None]  # [n_g, C_g]
            self._masks.append(_additive(allowed[:, None, None, :], dtype))
            self._columns.append(lengths[first:end])
        allowed = torch.arange(self.capacity, device=self.device)[None, :] <= lengths[:, None]  # [S, C]
        return lengths[:, None].clone(), _additive(allowed[:, None, None, :], dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """New keys/values [S or 1, kv, q, d] of one layer -> stored; returns what to attend to:
        prefill of one slot: its row [1, kv, C_g, d]; packed prefill: the packed sequence itself
        [1, kv, Q, d]; decoding: the inputs, unused (`grouped_attention` reads the groups)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._pack is not None:  # segment i -> columns 0..n_i-1 of slot i's row
            offset = 0
            for s, n in zip(*self._pack):
                g, row = divmod(s, self.group_slots)
                self._fit_buffers(layer_idx, g, key_states)
                keys[g][row, :, :n] = key_states[0, :, offset : offset + n]
                values[g][row, :, :n] = value_states[0, :, offset : offset + n]
                offset += n
            return key_states, value_states
        if self._slot is not None:  # prefill of one slot: [1, kv, q, d] at its next columns
            s, q = self._slot, key_states.shape[2]
            g, row, start = s // self.group_slots, s % self.group_slots, int(self.lengths[s])
            self._fit_buffers(layer_idx, g, key_states)
            keys[g][row, :, start : start + q] = key_states[0]
            values[g][row, :, start : start + q] = value_states[0]
            return keys[g][row : row + 1], values[g][row : row + 1]  # contiguous views of the slot
        if _DECODING.get() is not self:
            raise RuntimeError("decoding on a SlotKV reads its groups: run the model within grouped_attention_on(model, kv)")
        for g in range(self.num_groups):
            first, end = self.group_range(g)
            self._fit_buffers(layer_idx, g, key_states)
            rows, columns = self._group_rows(end - first), self._columns[g]
            keys[g][rows, :, columns] = key_states[first:end, :, 0]  # [n_g, kv, d] each at its slot's column
            values[g][rows, :, columns] = value_states[first:end, :, 0]
        return key_states, value_states

    def layer_groups(self, layer_idx: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Decoding: per group (first slot, end slot, keys, values [n_g, kv, C_g, d], mask [n_g, 1, 1, C_g])."""
        return [(*self.group_range(g), self.keys[layer_idx][g], self.values[layer_idx][g], self._masks[g])
                for g in range(self.num_groups)]

    def _group_rows(self, n: int) -> torch.Tensor:
        if n not in self._rows:
            self._rows[n] = torch.arange(n, device=self.device)
        return self._rows[n]

    def advance(self, slots: torch.Tensor, n: int | torch.Tensor) -> None:
        """After a forward: `slots` now hold their n new tokens (n: one count, or one per slot)."""
        self.lengths[slots] += n

    def forget_last(self, slot: int, n: int) -> None:
        """Drop slot's last n tokens (a reply cut short); the columns are overwritten later."""
        self.lengths[slot] -= n

    def clear(self, slot: int) -> None:
        """Empty a slot (its conversation starts afresh)."""
        self.lengths[slot] = 0

    def keep(self, slots: list[int]) -> None:
        """Keep only `slots`, renumbered 0.. in that order and regrouped; each C_g shrinks to what its slots hold."""
        old_lengths, old_group = self.lengths, self.group_slots
        self.lengths = old_lengths[torch.tensor(slots, dtype=torch.long)]
        self.capacities = []
        for g in range(self.num_groups):
            first, end = self.group_range(g)
            self.capacities.append(self._fit(int(self.lengths[first:end].max()) + 1 if end > first else 1))
        # new group g <- per old group o: (its rows in g, their rows in o) as index tensors, built once
        # for every layer: one gather per (g, o), not one copy per slot
        sources: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
        for g in range(self.num_groups):
            first, end = self.group_range(g)
            by_old: dict[int, tuple[list[int], list[int]]] = {}
            for row, s in enumerate(slots[first:end]):
                rows, old_rows = by_old.setdefault(s // old_group, ([], []))
                rows.append(row)
                old_rows.append(s % old_group)
            sources.append({o: (torch.tensor(r, device=self.device), torch.tensor(q, device=self.device))
                            for o, (r, q) in by_old.items()})
        for store in (self.keys, self.values):
            for layer, buffers in enumerate(store):
                like = next((b for b in buffers if b is not None), None)
                if like is None:
                    store[layer] = [None] * self.num_groups
                    continue
                regrouped = []
                for g, by_old in enumerate(sources):
                    first, end = self.group_range(g)
                    new = like.new_zeros(end - first, like.shape[1], self.capacities[g], like.shape[3])
                    for o, (rows, old_rows) in by_old.items():
                        old = buffers[o]  # None: that group never held a token
                        if old is not None:
                            width = min(self.capacities[g], old.shape[2])
                            new[rows.to(new.device), :, :width] = old[old_rows.to(old.device), :, :width]
                    regrouped.append(new)
                store[layer] = regrouped

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.slots else 0

    def _fit(self, columns: int) -> int:
        """Columns needed -> capacity: rounded up to GROW columns (and to at most `limit`, unless more are needed)."""
        rounded = -(-columns // GROW) * GROW
        return rounded if self.limit is None else max(columns, min(rounded, self.limit))

    def _reserve(self, g: int, columns: int) -> None:
        if columns > self.capacities[g]:
            self.capacities[g] = self._fit(columns)  # the group's buffers follow at their next update

    def _fit_buffers(self, layer: int, g: int, like: torch.Tensor) -> None:
        """Group g's buffers of `layer` exist and are C_g wide (zeros: masked columns are never NaN)."""
        current = self.keys[layer][g]
        if current is not None and current.shape[2] == self.capacities[g]:
            return
        first, end = self.group_range(g)
        _, heads, _, dim = like.shape
        for store in (self.keys, self.values):
            new = like.new_zeros(end - first, heads, self.capacities[g], dim)
            if store[layer][g] is not None:
                width = min(store[layer][g].shape[2], self.capacities[g])
                new[:, :, :width] = store[layer][g][:, :, :width]
            store[layer][g] = new


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> additive mask of 0 / -inf."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def grouped_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor, scaling: float, dropout: float = 0.0, **kwargs,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """query [R, H, q, d] -> ([R, q, H, d], None).

    Decoding with an active `SlotKV` (q == 1): each group of slots attends to its own buffer
    (`runtime.attention.gqa_one_query`); `key`/`value`/`attention_mask` are HF's and unused. Otherwise (a
    prefill, or no active cache) key/value [R, kv, C, d] and the additive mask [R, 1, q, C] are
    used as given: a prefill goes to `gqa_sdpa`, one query to `gqa_one_query` (runtime.attention: the one
    grouped attention, shared with the engine's verify).
    """
    kv = _DECODING.get()
    if query.shape[2] == 1 and kv is not None and kv.decoding:
        parts = [gqa_one_query(query[first:end], k, v, mask, scaling)
                 for first, end, k, v, mask in kv.layer_groups(module.layer_idx)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), None
    if query.shape[2] == 1:
        return gqa_one_query(query, key.contiguous(), value.contiguous(), attention_mask, scaling), None
    return gqa_sdpa(query, key, value, attention_mask, scaling).transpose(1, 2), None  # [R, q, H, d]


AttentionInterface.register(ATTENTION, grouped_attention)


@contextmanager
def grouped_attention_on(model: torch.nn.Module, kv: Optional[SlotKV] = None) -> Iterator[None]:
    """Within the block, `model` attends with `grouped_attention`, reading `kv`'s groups when decoding;
    its own choice is restored after."""
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    token = _DECODING.set(kv)
    try:
        yield
    finally:
        _DECODING.reset(token)
        model.set_attn_implementation(before)
