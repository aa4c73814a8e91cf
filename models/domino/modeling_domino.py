"""The Domino draft model: a DFlash block-parallel backbone plus a causal GRU logit correction.

Read top to bottom: norms and RoPE -> attention with the target context as extra K/V ->
decoder layer -> the context KV cache used at inference -> `DFlashDraftModel` (backbone forward,
Domino head, rollout).

Backbone. A block `[x_a, MASK x (Bk-1)]` is embedded with the target's frozen embedding table and
runs through Qwen3-style layers. The target context enters every layer as extra keys/values:

    target_hidden = hidden_norm(fc(cat of n target layer outputs))      [B, S, H]
    layer i:  K = [k_norm(k_proj_i(target_hidden)) ; k_norm(k_proj_i(h_block))]  (+ RoPE)
              V = [v_proj_i(target_hidden) ; v_proj_i(h_block)]
              Q = q_norm(q_proj_i(h_block))                                      (+ RoPE)

Context rows sit at their absolute positions 0..S-1, block slot j at position a+j. Attention inside
a block is bidirectional. The model returns z = norm(h) `[B, Q, H]`; the caller applies the target's
frozen lm_head to get the base logits u.

Head (shift_label = true: slot j predicts x[a+1+j]). A bias-free GRU reads target embeddings of
the block's realised tokens from a zero state; s_j has consumed [x_a, d_1 .. d_j]. Slots
j >= pure_draft_prefix_len get `u_j + W2 . SiLU(W1 . [z_j ; s_j])`; earlier slots keep u_j.

The model owns neither the embedding table nor the LM head: both are the target's.
Imports: torch and transformers only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from .configuration_domino import DominoDraftConfig

try:  # flex_attention exists from torch 2.5; the boolean SDPA mask is the fallback everywhere
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - old torch
    BlockMask, flex_attention = None, None

# A boolean mask [B or 1, 1, Q, C+Q] (True = may attend) or a flex_attention BlockMask.
AttentionMask = Union[torch.Tensor, "BlockMask", None]
_compiled_flex = None


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


class DominoRMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 (Qwen3 convention): [..., D] -> [..., D]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Absolute positions [B or 1, T] -> (cos, sin) [B or 1, 1, T, head_dim], rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, heads, T, D] by (cos, sin) [B or 1, 1, T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DominoMLP(nn.Module):
    """SwiGLU: down(SiLU(gate(x)) * up(x)), [..., H] -> [..., H]."""

    def __init__(self, config: DominoDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, h, Q, D], k/v [B, kvh, K, D] -> [B, h, Q, D]. GQA by repeating kv heads for SDPA."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        global _compiled_flex
        if q.is_cuda:  # the fused kernel needs torch.compile; eager flex materialises the scores
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention)
            return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=True)
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class DominoAttention(nn.Module):
    """Block queries attend to [context K/V ; block K/V]; one layer's own projections for both."""

    def __init__(self, config: DominoDraftConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = DominoRMSNorm(D, config.rms_norm_eps)  # per head
        self.k_norm = DominoRMSNorm(D, config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rows [B, T, H] at RoPE (cos, sin) -> k, v [B, kvh, T, D] (k normed and rotated)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, h, context_k, context_v, cos, sin, mask: AttentionMask) -> torch.Tensor:
        """Block h [B, Q, H], context k/v [B, kvh, C, D], block RoPE [.., Q, D] -> [B, Q, H]."""
        B, Q, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)  # [B, h, Q, D]
        k, v = self.project_kv(h, cos, sin)  # [B, kvh, Q, D]; never cached
        k = torch.cat([context_k, k], dim=2)  # [B, kvh, C+Q, D]
        v = torch.cat([context_v, v], dim=2)
        out = _attend(q, k, v, mask)  # [B, h, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.num_heads * self.head_dim))


class DominoDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer; the context is K/V only (no queries, no MLP, no residual for it)."""

    def __init__(self, config: DominoDraftConfig):
        super().__init__()
        self.self_attn = DominoAttention(config)
        self.mlp = DominoMLP(config)
        self.input_layernorm = DominoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DominoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, context_k, context_v, cos, sin, mask: AttentionMask) -> torch.Tensor:
        """[B, Q, H] -> [B, Q, H]."""
        h = h + self.self_attn(self.input_layernorm(h), context_k, context_v, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# Inference-time context cache
# ----------------------------------------------------------------------------------------------


class DraftContextCache:
    """Per-layer K/V of committed context rows, `keys[i]`/`values[i]` [B, kvh, C, D].

    Invariant: rows 0..C-1 hold the context at absolute positions 0..C-1. Block K/V are
    never stored, so after a round the cache holds exactly the committed context.
    """

    def __init__(self, num_layers: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_layers
        self.values: list[Optional[torch.Tensor]] = [None] * num_layers

    @property
    def length(self) -> int:
        """Number of cached context rows C."""
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add rows k/v [B, kvh, T, D] after the cached ones of `layer`."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)

    def crop(self, n: int) -> None:
        """Keep the first n context rows of every layer."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :n], v[:, :, :n]


@dataclass
class DraftRollout:
    """Result of one block rollout: draft tokens d_1..d_K [B, K] and the logits q [B, K, V] they
    were drawn from (corrected for slots >= pure_draft_prefix_len when the head is on; -inf outside
    the candidate pool), or None when the caller did not keep them."""

    tokens: torch.Tensor
    logits: Optional[torch.Tensor]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[B, N] -> argmax positions [B], ties to the lowest. Half-precision rows are compared in fp32
    (an exact cast: the same index, and twice as fast as a bf16 argmax on CPU)."""
    return (logits.float() if logits.element_size() < 4 else logits).argmax(dim=-1)


# ----------------------------------------------------------------------------------------------
# The draft model
# ----------------------------------------------------------------------------------------------


class DominoPreTrainedModel(PreTrainedModel):
    """HF plumbing shared by the draft: config class, no name prefix, weight initialisation."""

    config_class = DominoDraftConfig
    base_model_prefix = ""
    _no_split_modules = ["DominoDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """HF convention: Linear ~ N(0, initializer_range), norms = 1, GRU ~ U(+-1/sqrt(G)) (PyTorch's).
        Parameters already loaded from a checkpoint carry `_is_hf_initialized` and are skipped."""
        for p in module.parameters(recurse=False):
            if getattr(p, "_is_hf_initialized", False):
                continue
            if isinstance(module, nn.Linear):
                p.normal_(0.0, self.config.initializer_range)
            elif isinstance(module, DominoRMSNorm):
                p.fill_(1.0)
            elif isinstance(module, nn.GRU):
                bound = 1.0 / math.sqrt(module.hidden_size)
                p.uniform_(-bound, bound)


class DFlashDraftModel(DominoPreTrainedModel):
    """DFlash backbone + Domino head. State dict: layers.*, fc, hidden_norm, norm, prefix_gru, embed_proj."""

    def __init__(self, config: DominoDraftConfig):
        super().__init__(config)
        H, G, r = config.hidden_size, config.gru_hidden_dim, config.emb_dim
        self.layers = nn.ModuleList([DominoDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.fc = nn.Linear(config.num_feature_layers * H, H, bias=False)
        self.hidden_norm = DominoRMSNorm(H, config.rms_norm_eps)
        self.norm = DominoRMSNorm(H, config.rms_norm_eps)
        # Domino head. nn.GRU only holds the weights (weight_ih_l0 [3G, H], weight_hh_l0 [3G, G],
        # gate order r, z, n); the recurrences below read them directly.
        self.prefix_gru = nn.GRU(H, G, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(H + G, r, bias=False), nn.SiLU(), nn.Linear(r, config.vocab_size, bias=False))
        self.post_init()

    # ---- backbone ------------------------------------------------------------------------------

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [B, S, n*H] -> target_hidden [B, S, H]."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def _context_kv(self, target_features: torch.Tensor, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context rows [B, S, n*H] at positions start..start+S-1 -> per layer (k, v) [B, kvh, S, D]."""
        target_hidden = self.project_context(target_features)  # [B, S, H]
        positions = torch.arange(start, start + target_hidden.shape[1], device=target_hidden.device)[None]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, target_hidden.dtype)
        return [layer.self_attn.project_kv(target_hidden, cos, sin) for layer in self.layers]

    def extend_context(self, target_features: torch.Tensor, cache: DraftContextCache) -> None:
        """Newly committed rows [B, S_new, n*H] -> appended to `cache` at positions C..C+S_new-1.
        K/V only (fc, hidden_norm, k/v projections, k_norm, RoPE): no queries, no block."""
        for i, (k, v) in enumerate(self._context_kv(target_features, cache.length)):
            cache.append(i, k, v)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        target_features: Optional[torch.Tensor] = None,
        attention_mask: AttentionMask = None,
        cache: Optional[DraftContextCache] = None,
    ) -> torch.Tensor:
        """Block embeddings [B, Q, H] at positions [B or 1, Q] -> z = norm(h) [B, Q, H].

        Training (cache None): `target_features` [B, S, n*H] are the whole context at positions
        0..S-1, and `attention_mask` ([B or 1, 1, Q, S+Q] bool or a BlockMask) says which context
        rows and block slots each query sees.
        Inference (cache given): `target_features` are the newly committed rows (or None); they
        are appended to the cache first (`extend_context`), then the block attends to the whole
        cache and to itself (`attention_mask` None = everything visible).
        """
        h = block_embeds.to(self.fc.weight.dtype)
        if block_positions.dim() == 1:
            block_positions = block_positions[None]
        if cache is not None:
            if target_features is not None:
                self.extend_context(target_features, cache)
            context = list(zip(cache.keys, cache.values))  # per layer [B, kvh, C, D]
        elif target_features is not None:
            context = self._context_kv(target_features, 0)
        else:
            raise ValueError("the draft needs target context: pass target_features or a cache")
        if context[0][0] is None:
            raise ValueError("the draft context cache is empty: pass target_features")
        cos, sin = rope_cos_sin(block_positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context):
            h = layer(h, context_k, context_v, cos, sin, attention_mask)
        return self.norm(h)

    # ---- Domino head ---------------------------------------------------------------------------

    def gru_step(self, embed: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One bias-free GRU cell step: token embedding [N, H], state [N, G] -> new state [N, G]."""
        w_ih, w_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        return torch.gru_cell(embed.to(w_ih.dtype), state.to(w_ih.dtype), w_ih, w_hh, None, None)

    def gru_states(self, prefix_embeds: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: embeddings of x[a..a+Bk-1] [N, Bk, H] -> states [N, Bk, G] from zero;
        state j has consumed x[a..a+j]. Same math as nn.GRU (bias-free, gates r, z, n)."""
        N, Bk, _ = prefix_embeds.shape
        w_hh = self.prefix_gru.weight_hh_l0  # [3G, G]
        gi = F.linear(prefix_embeds.to(w_hh.dtype), self.prefix_gru.weight_ih_l0)  # [N, Bk, 3G], all slots at once
        s = gi.new_zeros(N, w_hh.shape[1])
        states = []
        for j in range(Bk):
            i_r, i_z, i_n = gi[:, j].chunk(3, dim=-1)
            h_r, h_z, h_n = F.linear(s, w_hh).chunk(3, dim=-1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            s = (1 - z) * torch.tanh(i_n + r * h_n) + z * s
            states.append(s)
        return torch.stack(states, dim=1)

    def correction_hidden(self, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """SiLU(W1 . [z ; s]): z [..., H], s [..., G] -> [..., r]."""
        return F.silu(self.embed_proj[0](torch.cat([z, s.to(z.dtype)], dim=-1)))

    def correction(self, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Logit delta W2 . SiLU(W1 . [z ; s]): z [..., H], s [..., G] -> [..., V]."""
        return self.embed_proj[2](self.correction_hidden(z, s))

    def final_logits(self, base_logits: torch.Tensor, z: torch.Tensor, states: torch.Tensor,
                     vocab_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """u [N, Bk, V], z [N, Bk, H], GRU states [N, Bk, G] -> u + delta [N, Bk, V].

        Slots j < pure_draft_prefix_len keep u exactly (their hidden is zeroed, so no gradient
        reaches the head from them). One fused addmm: no separate [N, Bk, V] delta tensor.
        `vocab_ids` [V'] (training over a loss vocabulary): u holds those columns only, and so
        does delta (rows vocab_ids of W2).
        """
        N, Bk, V = base_logits.shape
        mid = self.correction_hidden(z, states)  # [N, Bk, r]
        keep = torch.arange(Bk, device=mid.device) >= self.config.pure_draft_prefix_len
        mid = mid * keep[None, :, None].to(mid.dtype)
        w2 = self.embed_proj[2].weight  # [V, r]
        if vocab_ids is not None:
            w2 = w2[vocab_ids]  # [V', r]
        out = torch.addmm(base_logits.reshape(N * Bk, V), mid.reshape(N * Bk, -1).to(w2.dtype), w2.t())
        return out.view(N, Bk, V)

    @torch.no_grad()
    def rollout(
        self,
        z: torch.Tensor,
        base_logits: torch.Tensor,
        last_token: torch.Tensor,
        embed_tokens: nn.Module,
        sampler: Callable[[torch.Tensor], torch.Tensor] = greedy,
        num_draft: Optional[int] = None,
        pool: Optional[torch.Tensor] = None,
        keep_logits: bool = True,
    ) -> DraftRollout:
        """Draft one block: z [B, Bk, H], base logits u [B, Bk, V], the last committed token x_start
        [B] -> d_1..d_K [B, K] and the logits each was drawn from (K = num_draft or Bk). Unbatched
        z [Bk, H], u [Bk, V], x_start [1] (or 0-d) give tokens [K] and logits [K, V].

        With the head on, slot j >= P (pure_draft_prefix_len) scores u_j + W2 . SiLU(W1 . [z_j ; s_j]),
        where s_j has consumed [x_start, d_1..d_j]: K sequential GRU steps; slots j < P score u_j.
        `sampler` maps scored logits [B, N] -> positions [B] in 0..N-1 (greedy by default; the engine
        passes the same warping it applies to the target).

        `pool` [M] token ids (a candidate pool): the corrected slots score only these columns
        (u_j and the rows of W2 gathered once), N = M, and positions map back through the pool;
        tokens outside it are never drawn. Slots < P still score the full vocabulary.
        `keep_logits` False skips building the [B, K, V] logits (the engine's greedy chains).
        """
        unbatched = z.dim() == 2
        K = num_draft or base_logits.shape[-2]
        head = self.config.use_domino_head
        P = min(self.config.pure_draft_prefix_len, K) if head else K
        w2 = self.embed_proj[2].weight  # [V, r]
        scored = base_logits
        if head and pool is not None:  # gathered once a block, before any rows are expanded
            w2, scored = w2.index_select(0, pool), base_logits.index_select(-1, pool)  # [M, r], [..., Bk, M]
        if unbatched:
            z, base_logits, scored = (t[None] for t in (z, base_logits, scored))
        B, V = base_logits.shape[0], base_logits.shape[-1]
        if not head:  # pure DFlash: independent draws from u, all slots at once
            tokens = sampler(base_logits[:, :K].reshape(B * K, V)).view(B, K)
            out = DraftRollout(tokens, base_logits[:, :K] if keep_logits else None)
            return DraftRollout(out.tokens[0], None if out.logits is None else out.logits[0]) if unbatched else out
        state = None
        if head:  # s_0 has consumed x_start (computed once when every row shares it)
            x = last_token.reshape(-1)
            state = self.gru_step(embed_tokens(x), z.new_zeros(x.numel(), self.config.gru_hidden_dim))
            state = state.expand(B, -1) if x.numel() == 1 else state
        tokens, logits = [], []
        for j in range(K):
            if j < P:
                q = base_logits[:, j]
                d = sampler(q)
            else:
                mid = self.correction_hidden(z[:, j], state)  # [B, r]
                q = scored[:, j] + F.linear(mid.to(w2.dtype), w2)  # [B, N]
                d = sampler(q)
                d = d if pool is None else pool[d]
            tokens.append(d)
            if keep_logits:
                dense = q.shape[-1] == V
                logits.append(q if dense else q.new_full((B, V), float("-inf")).index_copy_(1, pool, q))
            if head and j + 1 < K:
                state = self.gru_step(embed_tokens(d), state)  # s_{j+1}
        out = DraftRollout(torch.stack(tokens, dim=1), torch.stack(logits, dim=1) if keep_logits else None)
        if unbatched:
            return DraftRollout(out.tokens[0], None if out.logits is None else out.logits[0])
        return out


__all__ = ["DFlashDraftModel", "DominoPreTrainedModel", "DraftContextCache", "DraftRollout", "greedy"]
