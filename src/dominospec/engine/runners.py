"""The runners one engine decodes on, chosen once: dynamic caches, static caches (CUDA graphs on a
GPU, transformers' forward), or the lean decoder (models.lean, its own caches and kernels).

`EngineRunners.pair(rows)` -> (target KV runner, draft block runner or None), reset, for a
generation of at most `rows` positions:
- static caches (`engine.cuda_graphs` static | on) when `rows` fit `graph_capacity`: the smallest
  capacity bucket that holds them (`static_buckets`), built and captured on first use and kept;
- dynamic caches otherwise (a longer generation, or `cuda_graphs: off`).
The lean decoder (`engine.lean_target`) replaces transformers' forward on the static caches: "on"
insists (an error names what does not fit), "auto" takes it on CUDA where the target is supported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dominospec.engine.draft_block import DynamicDraftBlock, StaticDraftBlock
from dominospec.engine.fork import MAX_TREE_ROWS
from dominospec.engine.lean_draft import LeanDraft, LeanDraftBlock
from dominospec.engine.lean_kv import LeanTargetKV
from dominospec.engine.target_kv import DynamicTargetKV, StaticTargetKV
from dominospec.errors import UserError
from dominospec.models.lean import DecoderOps, LeanDecoder, unsupported
from dominospec.target import Target

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
    """One engine's runners (module docstring). `max_rows`: the widest forward after the prompt (the
    verify of x_start and a round's proposal, or the draft block); `draft`: the draft path's model
    (None without a draft) with its LM head, the block's MASK embeddings and the target layers it reads.
    The target's lean decoder is the target's (`lean_decoder`, shared by its engines); the draft's
    lean backbone is this engine's own."""

    def __init__(self, target: Target, params: Any, max_rows: int, device: torch.device, static: bool, graphs: bool,
                 packed: bool, draft: Any = None, draft_lm_head: Any = None, embed_tokens: Any = None,
                 mask_embeds: Optional[torch.Tensor] = None, layer_ids: tuple[int, ...] = ()):
        self.target, self.model = target, target.model
        self.params, self.max_rows, self.device = params, max_rows, device
        self.static, self.graphs = static, graphs
        self.draft, self.draft_lm_head = draft, draft_lm_head
        self.embed_tokens, self.mask_embeds = embed_tokens, mask_embeds
        self.layer_ids = list(layer_ids)
        self.buckets: dict[int, tuple] = {}  # capacity -> (target runner, draft runner or None), built on first use
        self.last: tuple = (None, None)  # the pair the current (or last) generation runs on
        self.lean = self.lean_draft = None
        self.choose_lean(packed)

    def choose_lean(self, packed: bool) -> None:
        choice = self.params.lean_target
        if choice not in ("on", "off", "auto"):
            raise UserError(f"engine.lean_target must be on, off or auto, got {choice!r}")
        if choice == "off" or not self.static:
            return
        problem = (unsupported(self.model) or (self.max_rows > MAX_TREE_ROWS and
                                               f"its widest round verifies {self.max_rows} rows, over {MAX_TREE_ROWS}")
                   or (packed and "the draft path's linears are packed for oneDNN (engine.linear)"))
        if choice == "auto" and (problem or self.device.type != "cuda"):
            return
        if problem:
            raise UserError(f"engine.lean_target: on, but this engine cannot use it: {problem} "
                            "(lower engine.tree_width / tree_nodes / ngram_num_draft, or set lean_target: auto)")
        triton = self.device.type == "cuda"
        self.lean = lean_decoder(self.target, triton)
        if self.draft is not None:
            self.lean_draft = LeanDraft(self.draft, DecoderOps.on(triton))

    def capacities(self) -> list[int]:
        """The static caches' capacity buckets (`static_buckets`)."""
        return static_buckets(self.params.graph_capacity, MIN_BUCKET)

    def fits_static(self, rows: int) -> bool:
        return self.static and rows <= self.params.graph_capacity

    def pair(self, rows: int) -> tuple[Any, Any]:
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

    def build(self, capacity: int) -> tuple[Any, Any]:
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

    def failures(self) -> dict[str, str]:
        """Shapes whose CUDA-graph capture failed (they run eagerly) -> the error, by runner, capacity and shape."""
        failures = {}
        for capacity, pair in self.buckets.items():
            for name, runner in zip(("target", "draft"), pair):
                if runner is not None:
                    failures.update({f"{name} {capacity} {key}": err for key, err in runner.graphs.failures.items()})
        return failures
