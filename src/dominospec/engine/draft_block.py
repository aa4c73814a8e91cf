"""The draft's side of a round (the `DraftRunner` Protocol, engine.runner_types): block(features [1, S, n*H]
or None, x_start [1], start, K) -> (z [K, H], u [K, V]) appends the S new context rows (positions
start-S..start-1), then runs [x_start, MASK x (B-1)] at start..start+B-1 (slot j drafts d_{j+1}), all in
the draft path's dtype.

- `DynamicDraftBlock`: the model's own `DraftContextCache`, eager.
- `StaticDraftBlock`: per-layer K/V buffers [1, kvh, capacity, D] written in place, the block attending
  through an explicit mask [1, 1, B, capacity + B]. "Append S rows + block" is one shape per S, so
  S = 0..B replay CUDA graphs (`GraphedBlock`); more rows at once are appended eagerly first.
- `LeanDraftBlock`: the same on the draft's backbone on the lean decoder's fused ops
  (models.lean.lean_draft.LeanDraft), its cache [layers, Hkv, capacity + B, D] holding the block's own
  B rows after the context's; the S rows and the block are one pass, one graph per S <= B.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dominospec.engine.graphs import FixedRows, ShapeGraphs
from dominospec.models.domino import DFlashDraftModel, DraftContextCache
from dominospec.models.domino.modeling_domino import rope_cos_sin
from dominospec.models.lean.lean_draft import LeanDraft

Output = tuple[torch.Tensor, torch.Tensor]


class DynamicDraftBlock:
    """Eager draft forwards on a growing `DraftContextCache`."""

    def __init__(self, draft: DFlashDraftModel, lm_head: Any, embed_tokens: Any, mask_embeds: torch.Tensor):
        self.draft, self.lm_head, self.embed_tokens = draft, lm_head, embed_tokens
        self.mask_embeds = mask_embeds  # [B-1, H], draft dtype
        self.context = DraftContextCache(len(draft.layers))

    def reset(self) -> None:
        self.context = DraftContextCache(len(self.draft.layers))

    @property
    def length(self) -> int:
        return self.context.length

    def extend(self, features: torch.Tensor) -> None:
        self.draft.extend_context(features, self.context)

    def crop(self, n: int) -> None:
        self.context.crop(n)

    def block(self, features: Optional[torch.Tensor], x_start: torch.Tensor, start: int, K: int) -> Output:
        dtype = self.mask_embeds.dtype
        block = torch.cat([self.embed_tokens(x_start).to(dtype), self.mask_embeds])[None]  # [1, B, H]
        positions = torch.arange(start, start + block.shape[1], device=block.device)[None]
        z = self.draft(block, positions, target_features=features, cache=self.context)[0, :K]  # [K, H]
        return z, self.lm_head(z)


class GraphedBlock(FixedRows):
    """A draft runner whose "append S rows + block" is one graph per S <= B (engine.graphs) over the
    buffers `start` (0-d), `x_start` [1] and `features[S]` [1, S, n*H]; the subclass gives the graph's
    function (`_step(S)`) and `_extend` for the rows that come more than B at a time."""

    what = "draft context"

    def __init__(self, lm_head: Any, embed_tokens: Any, mask_embeds: torch.Tensor, capacity: int, feature_dim: int,
                 graphs: bool):
        super().__init__(capacity)
        self.lm_head, self.embed_tokens = lm_head, embed_tokens
        self.mask_embeds = mask_embeds  # [B-1, H], the draft path's dtype
        self.B = mask_embeds.shape[0] + 1
        device, dtype = mask_embeds.device, mask_embeds.dtype
        self.start = torch.zeros((), dtype=torch.long, device=device)  # the block's first position
        self.x_start = torch.zeros(1, dtype=torch.long, device=device)
        self.features = {S: torch.zeros(1, S, feature_dim, dtype=dtype, device=device) for S in range(1, self.B + 1)}
        self.graphs = ShapeGraphs(self._step, enabled=graphs)

    def embeds(self) -> torch.Tensor:
        """The block's embeddings [B, H]: x_start's, then the MASK slots'."""
        return torch.cat([self.embed_tokens(self.x_start).to(self.mask_embeds.dtype), self.mask_embeds])

    def extend(self, features: torch.Tensor) -> None:
        """Rows [1, S, n*H] appended at positions length..length+S-1 (eager)."""
        S = features.shape[1]
        self.check_room(S)
        self._extend(features.to(self.mask_embeds.dtype), S)
        self.length += S

    def block(self, features: Optional[torch.Tensor], x_start: torch.Tensor, start: int, K: int) -> Output:
        S = 0 if features is None else features.shape[1]
        if S > self.B:
            self.extend(features)
            S = 0
        if self.length + S != start:
            raise ValueError(f"draft context holds {self.length} + {S} rows, the block starts at {start}")
        self.check_room(S + self.B)
        self.start.fill_(start)
        self.x_start.copy_(x_start)
        if S:
            self.features[S].copy_(features)
        z, base_logits = self.graphs.run(S)  # [B, H], [B, V]: every slot, one shape
        self.length += S
        return z[:K], base_logits[:K]


class StaticDraftBlock(GraphedBlock):
    """Draft forwards on static context buffers; "append S rows + block" replays a CUDA graph per S <= B."""

    def __init__(self, draft: DFlashDraftModel, lm_head: Any, embed_tokens: Any, mask_embeds: torch.Tensor,
                 capacity: int, graphs: bool):
        self.draft = draft
        config = draft.config
        shape = (1, int(config.num_key_value_heads), capacity, int(config.head_dim))
        self.keys = [mask_embeds.new_zeros(shape) for _ in draft.layers]
        self.values = [mask_embeds.new_zeros(shape) for _ in draft.layers]
        self.columns = torch.arange(capacity, device=mask_embeds.device)  # [L]
        super().__init__(lm_head, embed_tokens, mask_embeds, capacity, draft.fc.weight.shape[1], graphs)

    def _extend(self, features: torch.Tensor, S: int) -> None:
        self.start.fill_(self.length + S)
        self._append(features)

    def _step(self, S: int):
        """S -> the graph's function: append `features[S]`, then the block at `start`."""
        def step() -> Output:
            if S:
                self._append(self.features[S])
            return self._block()
        return step

    def _append(self, features: torch.Tensor) -> None:
        """Rows [1, S, n*H] -> context K/V at positions start-S..start-1 of every layer (tensor ops only)."""
        S = features.shape[1]
        positions = self.start - S + torch.arange(S, device=self.start.device)  # [S]
        hidden = self.draft.project_context(features)  # [1, S, H]
        config = self.draft.config
        cos, sin = rope_cos_sin(positions[None], config.head_dim, config.rope_theta, hidden.dtype)
        for i, layer in enumerate(self.draft.layers):
            k, v = layer.self_attn.project_kv(hidden, cos, sin)  # [1, kvh, S, D]
            self.keys[i].index_copy_(2, positions, k)
            self.values[i].index_copy_(2, positions, v)

    def _block(self) -> Output:
        """[x_start, MASK x (B-1)] at positions start.. -> z [B, H], u [B, V] (tensor ops only)."""
        block = self.embeds()[None]  # [1, B, H]
        positions = self.start + torch.arange(self.B, device=self.start.device)  # [B]
        context = (self.columns < self.start)[None].expand(self.B, -1)  # [B, L]
        own = torch.ones(self.B, self.B, dtype=torch.bool, device=context.device)
        mask = torch.cat([context, own], dim=1)[None, None]  # [1, 1, B, L+B]
        cache = DraftContextCache(len(self.keys))
        cache.keys, cache.values = list(self.keys), list(self.values)
        z = self.draft(block, positions[None], attention_mask=mask, cache=cache)[0]  # [B, H]: slot j drafts d_{j+1}
        return z, self.lm_head(z)


class LeanDraftBlock(GraphedBlock):
    """Draft forwards on the lean backbone's cache; "append S rows + block" replays a CUDA graph per S <= B."""

    def __init__(self, lean: LeanDraft, lm_head: Any, embed_tokens: Any, mask_embeds: torch.Tensor, capacity: int,
                 graphs: bool):
        self.lean, B = lean, mask_embeds.shape[0] + 1
        device, dtype = mask_embeds.device, mask_embeds.dtype
        self.keys, self.values = lean.stack.new_cache(capacity + B, dtype, device)  # + the block's own rows
        lean.ensure_positions(capacity + B, dtype)
        self.bits = torch.full((B,), (1 << B) - 1, dtype=torch.long, device=device)  # each slot sees all B
        self.workspace = lean.stack.workspace_for(B, device)  # the block attention's scratch
        super().__init__(lm_head, embed_tokens, mask_embeds, capacity, lean.fc.shape[1], graphs)

    def _extend(self, features: torch.Tensor, S: int) -> None:
        self.start.fill_(self.length)
        self.lean.append(features[0], self.start, self.keys, self.values)

    def _step(self, S: int):
        """S -> the graph's function: append `features[S]` at start-S.., then the block at `start`."""
        def step() -> Output:
            z = self.lean.block(self.embeds(), self.start, self.bits, self.keys, self.values, self.workspace,
                                self.features[S][0] if S else None)
            return z, self.lm_head(z)
        return step
