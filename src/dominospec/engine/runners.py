"""The runners one engine decodes on, as its Decoding says: `EngineRunners.pair(rows)` -> (target runner,
draft runner or None), reset, for a generation of at most `rows` positions: static caches (Decoding.static)
of the smallest capacity bucket that holds them (`static_buckets`), built on first use and kept, their
CUDA graphs (Decoding.graphs) captured on first use or by `capture`, on the lean decoder when
Decoding.lean; dynamic caches otherwise. `graph_failures` names every shape whose capture failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from dominospec.engine.decoding import Decoding
from dominospec.engine.draft_block import DynamicDraftBlock, LeanDraftBlock, StaticDraftBlock
from dominospec.engine.target_kv import LeanForward
from dominospec.engine.runner_types import DraftRunner, TargetRunner
from dominospec.engine.sampling import Sampling
from dominospec.engine.target_kv import DynamicTargetKV, HFForward, StaticTargetKV
from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.models.lean.lean_draft import LeanDraft
from dominospec.target import Target

if TYPE_CHECKING:
    from dominospec.engine.draft_path import DraftPath

MIN_BUCKET = 256  # the smallest static-cache capacity (rows); see static_buckets


def static_buckets(capacity: int, smallest: int = MIN_BUCKET) -> list[int]:
    """Capacities of the static caches, ascending: `smallest`, doubling, up to `capacity` (the last). A
    forward on transformers' static cache attends over all its rows (masked): the smallest bucket wins."""
    buckets, rows = [], smallest
    while rows < capacity:
        buckets.append(rows)
        rows *= 2
    return buckets + [capacity]


def lean_decoder(target: Target, triton: bool) -> LeanDecoder:
    """The target's lean decoder on the Triton kernels (`triton`) or their references, built once and kept
    on the target (`Target.lean`) for all its engines: it holds a copy of the fused weights (models.lean)."""
    ops = DecoderOps.on(triton)
    if ops.name not in target.lean:
        target.lean[ops.name] = LeanDecoder(target.model, ops)
    return target.lean[ops.name]


class EngineRunners:
    """One engine's runners (module docstring). `path`: the draft as the engine runs it (engine.draft_path;
    None without a draft), whose model, LM head, MASK embeddings and target layers the draft runners take.
    The target's lean decoder is shared by its engines; the draft's lean backbone is this engine's own."""

    def __init__(self, target: Target, decoding: Decoding, path: Optional["DraftPath"] = None):
        self.model, self.device, self.embed_tokens = target.model, target.device, target.embed_tokens
        self.decoding, self.max_rows = decoding, decoding.max_rows
        self.static, self.graphs = decoding.static, decoding.graphs
        self.path = path
        self.draft, self.draft_lm_head = (path.model, path.lm_head) if path is not None else (None, None)
        self.layer_ids = list(path.layer_ids) if path is not None else []
        self.buckets: dict[int, tuple] = {}  # capacity -> (target runner, draft runner or None), built on first use
        self.last: tuple = (None, None)  # the pair the current (or last) generation runs on
        self.lean = self.lean_draft = None
        if decoding.lean:
            triton = self.device.type == "cuda"
            self.lean = lean_decoder(target, triton)
            if self.draft is not None:
                self.lean_draft = LeanDraft(self.draft, DecoderOps.on(triton))

    def capacities(self) -> list[int]:
        return static_buckets(self.decoding.capacity, MIN_BUCKET)

    def fits_static(self, rows: int) -> bool:
        return self.static and rows <= self.decoding.capacity

    def pair(self, rows: int) -> tuple[TargetRunner, Optional[DraftRunner]]:
        """A generation of at most `rows` positions -> (target KV runner, draft block runner or None), reset."""
        if self.fits_static(rows):
            capacity = next(c for c in self.capacities() if c >= rows)
            if capacity not in self.buckets:
                self.buckets[capacity] = self.build(capacity)
            kv, drafter = self.buckets[capacity]
        else:
            kv = DynamicTargetKV(self.model, self.layer_ids)
            drafter = None if self.draft is None else DynamicDraftBlock(self.draft, self.draft_lm_head,
                                                                        self.embed_tokens, self.path.mask_embeds)
        kv.reset()
        if drafter is not None:
            drafter.reset()
        self.last = (kv, drafter)
        return kv, drafter

    def build(self, capacity: int) -> tuple[TargetRunner, Optional[DraftRunner]]:
        """The static runners of one capacity bucket."""
        forward = LeanForward(self.lean) if self.lean is not None else HFForward(self.model)
        kv = StaticTargetKV(forward, self.layer_ids, capacity, self.max_rows, graphs=self.graphs)
        if self.draft is None:
            return kv, None
        runner, backbone = (LeanDraftBlock, self.lean_draft) if self.lean_draft else (StaticDraftBlock, self.draft)
        return kv, runner(backbone, self.draft_lm_head, self.embed_tokens, self.path.mask_embeds, capacity,
                          graphs=self.graphs)

    @torch.inference_mode()
    def capture(self, rows: int, num_draft: int) -> None:
        """Run once every shape a generation of at most `rows` positions replays on its static runners (the
        verify of each T rows, the draft block of each S new rows, the chain and tree of each K <=
        `num_draft`), so their graphs are captured before the first request. A no-op on dynamic caches."""
        if not self.fits_static(rows):
            return
        kv, drafter = self.pair(rows)
        ids = torch.zeros(1, kv.max_rows, dtype=torch.long, device=self.device)  # any ids: only the shapes matter
        _, features = kv.forward(ids[:, :2], keep=1)
        for T in kv.buckets:
            kv.forward(ids[:, :T], keep=T)
            kv.crop(2)
        if drafter is None:
            return
        drafter.extend(features[:, :1])
        x_start = ids[0, :1]
        B = self.decoding.block_size
        for S in range(B + 1):
            z, base_logits = drafter.block(features[:, :1].expand(1, S, -1) if S else None, x_start, 1 + S, B)
            drafter.crop(1)
        for K in range(1, num_draft + 1):
            self.path.head.chain(z[:K], base_logits[:K], x_start, Sampling(), None, self.decoding.cut > 0)
            if self.path.grower is not None:
                self.path.grower.grow(z[:K], base_logits[:K], x_start)

    def capture_all(self, num_draft: int) -> None:
        """On CUDA graphs: `capture` every capacity bucket (a server's start-up)."""
        if self.static and self.graphs:
            for capacity in self.capacities():
                self.capture(capacity, num_draft)

    def graph_failures(self) -> dict[str, str]:
        """Shapes whose CUDA-graph capture failed (they run eagerly) -> the error, by runner, capacity and shape."""
        failures = {}
        for capacity, pair in self.buckets.items():
            for name, runner in zip(("target", "draft"), pair):
                if runner is not None:
                    failures.update({f"{name} {capacity} {key}": err for key, err in runner.graphs.failures.items()})
        if self.path is not None and self.path.graphs is not None:
            failures.update(self.path.graphs.failures())
        return failures
