"""Continuous batched KV-cache decoding: replies start and finish at any step, one slot per key.

    stream = ReplyStream(model, kv, policy, generator)
    stream.start(key, new_tokens, budget)   # prefill the key's slot alone, then decode with the rest
    stream.step() -> [(key, Reply)]          # one token for every running reply; the finished ones
    stream.end(key)                          # the key is done: its slot is dropped (soon)

A key (a conversation) owns one slot of `SlotKV` for its life, so its next reply continues from
its cache. A new key's first tokens wait for the next `step`, which prefills all waiting ones
together, packed into sequences of <= `PREFILL_TOKENS` (no padding); a later reply's new tokens
are prefilled at once on their own, in chunks of <= `PREFILL_TOKENS` (batch 1). `step` picks the next token of every running reply from the last logits
([S, V]: greedy when `policy.temperature == 0`, else temperature then top_p, HF's order, drawn
from `generator`), ends the replies that hit a stop token, their budget, or a repetition loop
(`loops.py`), and feeds the others' tokens in one forward of all slots. Slots of ended keys
are dropped once they are an eighth of the batch, so they soon stop costing compute.

Why packed. A batch-1 prefill of a short first turn runs the linear layers well below what 1,024
packed rows reach on the 2-core Xeon, and the fixed cost of a forward is paid once per pack instead
of once per conversation; a right-aligned padded batch would instead spend most of its time on
padding (ShareGPT prompt lengths vary by an order of magnitude). The numbers are in
docs/journal/2026-12-01-a-faster-regenerate-stage-packed-first-turns-attention-per.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

import torch

from dominospec.regenerate.kv_batch import SlotKV
from dominospec.regenerate.loops import LoopDetector
from dominospec.runtime.kv import cache_argument

PREFILL_TOKENS = 1024  # tokens per prefill forward: bounds the [1, H, q, C] attention scores


@dataclass(frozen=True)
class DecodePolicy:
    """How replies are picked and where they stop."""

    stop_ids: tuple[int, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    loop_ngram: Optional[int] = None  # None: keep repetition loops
    loop_repeats: int = 3
    pad_id: int = 0


@dataclass
class Reply:
    """One finished reply."""

    tokens: list[int]  # the reply's content: stop token excluded, cut before a loop's second copy
    generated: int  # tokens the target generated for it (stop token and cut tokens included)
    stopped: bool  # ended on a stop token
    loop_cut: bool  # cut by the loop detector
    unfed: list[int]  # tail of `tokens` not in the slot's cache (the last token of a capped reply)
    stop: Optional[int] = None  # the stop token it ended on (static decoder; None: not stopped, or not recorded)


@dataclass
class _Running:
    budget: int
    loops: LoopDetector
    tokens: list[int] = field(default_factory=list)


class ReplyStream:
    """Replies of many keys decoded together (see the module doc)."""

    def __init__(
        self, model: torch.nn.Module, kv: SlotKV, policy: DecodePolicy, generator: Optional[torch.Generator] = None,
        on_tokens: Optional[Callable[[int], None]] = None,
    ):  # fmt: skip
        self.model, self.kv, self.policy, self.generator, self.on_tokens = model, kv, policy, generator, on_tokens
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.cache_arg = cache_argument(model)  # `cache` or `past_key_values`, by transformers version
        self.keys: list[Optional[Hashable]] = [None] * kv.slots  # slot -> key (None: free)
        self.slot_of: dict[Hashable, int] = {}
        self.running: dict[int, _Running] = {}  # slot -> its reply in progress
        self.logits: Optional[torch.Tensor] = None  # [S, V] next-token logits of each running slot
        self.waiting: dict[Hashable, list[int]] = {}  # new key -> its first tokens, prefilled at the next step

    def start(self, key: Hashable, new_tokens: list[int], budget: int) -> None:
        """Append `new_tokens` to the key's slot (a free one for a new key) and begin a reply of <= `budget` tokens."""
        assert new_tokens and budget >= 1 and key not in {self.keys[s] for s in self.running}
        if key not in self.slot_of:
            self.slot_of[key] = slot = self.keys.index(None)
            self.keys[slot] = key
            self.kv.clear(slot)
        slot = self.slot_of[key]
        self.running[slot] = _Running(budget, LoopDetector(self.policy.loop_ngram, self.policy.loop_repeats))
        if int(self.kv.lengths[slot]) == 0 and len(new_tokens) <= PREFILL_TOKENS:
            self.waiting[key] = new_tokens  # prefilled with the other new keys at the next step
            return
        for start in range(0, len(new_tokens), PREFILL_TOKENS):
            chunk = torch.tensor(new_tokens[start : start + PREFILL_TOKENS], dtype=torch.long)[None, :]  # [1, q]
            positions, mask = self.kv.prefill_slot(slot, chunk.shape[1], self.dtype)
            logits = self._forward(chunk, positions, mask, [chunk.shape[1] - 1])[0]  # [1, V]
            self.kv.advance(torch.tensor([slot]), chunk.shape[1])
        self._set_logits([slot], logits)

    def _prefill_waiting(self) -> None:
        """Prefill the waiting new keys' first tokens, packed into forwards of <= PREFILL_TOKENS tokens."""
        pack: list[tuple[int, list[int]]] = []
        packed = 0  # tokens in `pack`
        for key, tokens in self.waiting.items():
            if pack and packed + len(tokens) > PREFILL_TOKENS:
                self._prefill_pack(pack)
                pack, packed = [], 0
            pack.append((self.slot_of[key], tokens))
            packed += len(tokens)
        if pack:
            self._prefill_pack(pack)
        self.waiting.clear()

    def _prefill_pack(self, pack: list[tuple[int, list[int]]]) -> None:
        """(empty slot, its first tokens) pairs -> one forward of the packed sequence [1, Q]."""
        slots, lengths = [s for s, _ in pack], [len(t) for _, t in pack]
        ids = torch.tensor([t for _, tokens in pack for t in tokens], dtype=torch.long)[None, :]  # [1, Q]
        positions, mask = self.kv.prefill_packed(slots, lengths, self.dtype)
        ends = (torch.tensor(lengths).cumsum(0) - 1).tolist()  # each segment's last column
        logits = self._forward(ids, positions, mask, ends)[0]  # [n, V]
        self.kv.advance(torch.tensor(slots), torch.tensor(lengths))
        self._set_logits(slots, logits)

    def _set_logits(self, slots: list[int], logits: torch.Tensor) -> None:
        """Next-token logits [n, V] of `slots` (after their prefill)."""
        if self.logits is None:
            self.logits = logits.new_zeros(self.kv.slots, logits.shape[1])
        self.logits[torch.tensor(slots, device=logits.device)] = logits

    def step(self) -> list[tuple[Hashable, Reply]]:
        """One token for every running reply -> the replies that finished, with their keys."""
        if self.waiting:
            self._prefill_waiting()
        slots = sorted(self.running)
        if not slots:
            return []
        picked = next_tokens(self.logits[slots], self.policy, self.generator).tolist()  # [R]
        finished, going = [], []
        for slot, token in zip(slots, picked):
            reply = self._push(slot, token)
            if reply is None:
                going.append((slot, token))
            else:
                finished.append((self.keys[slot], reply))
        if self.on_tokens is not None:
            self.on_tokens(len(slots))
        if going:
            ids = torch.full((self.kv.slots, 1), self.policy.pad_id, dtype=torch.long)  # [S, 1]; idle slots: padding
            for slot, token in going:
                ids[slot, 0] = token
            positions, mask = self.kv.decode_all(self.dtype)
            logits = self._forward(ids, positions, mask, [0])[:, 0]  # [S, V]
            index = torch.tensor([s for s, _ in going])
            self.logits[index.to(self.device)] = logits[index.to(self.device)]
            self.kv.advance(index, 1)  # idle slots wrote a column past their length: overwritten later
        return finished

    def context_length(self, key: Hashable) -> int:
        """Tokens in the key's slot (0 without one)."""
        return int(self.kv.lengths[self.slot_of[key]]) if key in self.slot_of else 0

    def end(self, key: Hashable, compact: bool = True) -> None:
        """The key has no more replies: free its slot; compact once an eighth of the slots are free
        (not when `compact` is False: a key is about to take the slot again)."""
        slot = self.slot_of.pop(key)
        self.keys[slot] = None
        free = self.keys.count(None)
        if not compact or free == len(self.keys) or free < max(1, len(self.keys) // 8):
            return
        keep = [s for s, k in enumerate(self.keys) if k is not None]
        self.kv.keep(keep)
        self.logits = self.logits[keep] if self.logits is not None else None
        self.running = {keep.index(s): r for s, r in self.running.items()}
        self.keys = [self.keys[s] for s in keep]
        self.slot_of = {k: s for s, k in enumerate(self.keys)}

    def _push(self, slot: int, token: int) -> Optional[Reply]:
        """One picked token of a running reply -> the Reply when it ends here, else None."""
        run = self.running[slot]
        run.tokens.append(token)
        stopped = token in self.policy.stop_ids
        cut = None if stopped else run.loops.push(token)
        if not (stopped or cut is not None or len(run.tokens) >= run.budget):
            return None
        del self.running[slot]
        fed = len(run.tokens) - 1  # the token just picked was never fed
        if stopped:
            tokens, unfed = run.tokens[:-1], []
        elif cut is not None:
            tokens, unfed = run.tokens[:cut], []
            self.kv.forget_last(slot, fed - cut)  # tokens past the cut leave the cache
        else:
            tokens, unfed = run.tokens, run.tokens[-1:]
        return Reply(tokens=tokens, generated=len(run.tokens), stopped=stopped, loop_cut=cut is not None, unfed=unfed)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, columns: list[int]) -> torch.Tensor:
        """ids [R, q] -> logits of `columns` [R, k, V] (float32, on the model's device)."""
        keep = torch.tensor(columns, device=self.device)  # indices, not an int: HF's `[:, -1:]` slice is
        # a strided view, and a bf16 lm_head on it expands the [V, H] weight per row on CPU
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device), **{self.cache_arg: self.kv}, use_cache=True, logits_to_keep=keep,
            )  # fmt: skip
        return out.logits.float()


def next_tokens(logits: torch.Tensor, policy: DecodePolicy, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [R, V] -> next token ids [R]: argmax, or a draw after temperature and top_p."""
    if policy.temperature == 0:
        return logits.argmax(-1)
    logits = top_p_filter(logits / policy.temperature, policy.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [R, V] (after the temperature) -> the same with the low tail outside `top_p` at -inf (HF's order)."""
    if top_p >= 1:
        return logits
    ordered, order = logits.sort(-1)  # ascending, as HF's TopPLogitsWarper
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p  # [R, V] the low tail outside top_p
    drop[:, -1] = False  # keep at least the most likely token
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
