"""The runners one engine decodes on, chosen once: dynamic caches, static caches (CUDA graphs on a
GPU, transformers' forward), or the lean decoder (models.lean, its own caches and kernels).

Whether the caches are static, their graphs replayed and the target lean is the resolve step's
(engine.decoding: `static_caches`, `lean_target`), decided before the draft path, whose rollout and
tree graphs follow it too.
`EngineRunners.pair(rows)` -> (target KV runner, draft block runner or None), reset, for a
generation of at most `rows` positions:
- static caches (`engine.cuda_graphs` static | on) when `rows` fit `graph_capacity`: the smallest
  capacity bucket that holds them (`static_buckets`), built and captured on first use and kept;
- dynamic caches otherwise (a longer generation, or `cuda_graphs: off`).
The lean decoder (`engine.lean_target`) replaces transformers' forward on the static caches.
`capture` runs every shape of a bucket once beforehand (the verify, the draft block, the draft's
rollouts and tree), and `graph_failures` names the shapes whose capture failed, all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from dominospec.engine.decoding import Decoding
from dominospec.engine.draft_block import DynamicDraftBlock, StaticDraftBlock
from dominospec.engine.lean_draft import LeanDraft, LeanDraftBlock
from dominospec.engine.lean_kv import LeanTargetKV
from dominospec.engine.runner_types import DraftRunner, TargetRunner
from dominospec.engine.sampling import Sampling
from dominospec.engine.target_kv import DynamicTargetKV, StaticTargetKV
from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.target import Target

if TYPE_CHECKING:
    from dominospec.engine.draft_path import DraftPath

MIN_BUCKET = 256  # the smallest static-cache capacity (rows); see static_buckets


def static_buckets(capacity: int, smallest: int = MIN_BUCKET) -> list[int]:
    """Capacities of the static caches, ascending: `smallest`, doubling, up to `capacity` (the last).
    Every forward on a static cache of transformers' attends over all of its rows (masked), so a
    generation runs on the smallest bucket that holds it. Each bucket is built, and its graphs
    captured, when first used."""
    buckets, rows = [], smallest
    while rows < capacity:
        buckets.append(rows)
        rows *= 2
    return buckets + [capacity]


def lean_decoder(target: Target, triton: bool) -> LeanDecoder:
    """The target's lean decoder on the Triton kernels (`triton`) or their references, built once and
    kept on the target (`Target.lean`) for every engine on it: it holds a copy of the fused q/k/v
    and gate/up weights (models.lean)."""
    ops = DecoderOps.on(triton)
    if ops.name not in target.lean:
        target.lean[ops.name] = LeanDecoder(target.model, ops)
    return target.lean[ops.name]


class EngineRunners:
    """One engine's runners (module docstring), as its Decoding says (engine.decoding): static caches of
    `capacity` rows, their graphs, the lean decoder. `path`: the draft as the engine runs it
    (engine.draft_path; None without a draft), whose model, LM head, MASK embeddings and target layers
    the draft block runners take, and whose graph holder `capture` and `graph_failures` reach. The
    target's lean decoder is the target's (`lean_decoder`, shared by its engines); the draft's lean
    backbone is this engine's own."""

    def __init__(self, target: Target, decoding: Decoding, path: Optional["DraftPath"] = None):
        self.target, self.model, self.device = target, target.model, target.device
        self.decoding, self.max_rows = decoding, decoding.max_rows
        self.static, self.graphs = decoding.static, decoding.graphs
        self.embed_tokens = target.embed_tokens
        self.path = path
        self.draft = self.draft_lm_head = self.mask_embeds = None
        self.layer_ids: list[int] = []
        if path is not None:
            self.draft, self.draft_lm_head, self.mask_embeds = path.model, path.lm_head, path.mask_embeds
            self.layer_ids = list(path.layer_ids)
        self.buckets: dict[int, tuple] = {}  # capacity -> (target runner, draft runner or None), built on first use
        self.last: tuple = (None, None)  # the pair the current (or last) generation runs on
        self.lean = self.lean_draft = None
        if decoding.lean:
            triton = self.device.type == "cuda"
            self.lean = lean_decoder(target, triton)
            if self.draft is not None:
                self.lean_draft = LeanDraft(self.draft, DecoderOps.on(triton))

    def capacities(self) -> list[int]:
        """The static caches' capacity buckets (`static_buckets`)."""
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
                                                                        self.embed_tokens, self.mask_embeds)
        kv.reset()
        if drafter is not None:
            drafter.reset()
        self.last = (kv, drafter)
        return kv, drafter

    def build(self, capacity: int) -> tuple[TargetRunner, Optional[DraftRunner]]:
        """The static runners of one capacity bucket."""
        if self.lean is not None:
            kv = LeanTargetKV(self.lean, self.layer_ids, capacity, self.max_rows, graphs=self.graphs)
        else:
            kv = StaticTargetKV(self.model, self.layer_ids, capacity, self.max_rows, graphs=self.graphs)
        drafter = None
        if self.lean_draft is not None:
            drafter = LeanDraftBlock(self.lean_draft, self.draft_lm_head, self.embed_tokens, self.mask_embeds,
                                     capacity, graphs=self.graphs)
        elif self.draft is not None:
            drafter = StaticDraftBlock(self.draft, self.draft_lm_head, self.embed_tokens, self.mask_embeds,
                                       capacity, graphs=self.graphs)
        return kv, drafter

    @torch.inference_mode()
    def capture(self, rows: int, num_draft: int) -> None:
        """Run every shape a generation of at most `rows` positions can replay once, on its static
        runners: the verify of each T rows, the draft block of each S appended rows, the draft's
        rollout of each K <= `num_draft` (and its tree). Their CUDA
        graphs are then captured (and the kernels compiled) before the first request, not inside a
        timed one. A no-op on the dynamic caches."""
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
        """On CUDA graphs: `capture` every capacity bucket, so that no request waits for a capture
        (a server's start-up). A no-op without graphs."""
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
