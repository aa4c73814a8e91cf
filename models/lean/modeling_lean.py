"""The target's forward in nine launches a layer: a lean decoder for Llama / Qwen3-family targets at batch 1.

Read top to bottom: the kernel seam (`DecoderOps`) -> what a target must be (`unsupported`) -> one
layer's weights, fused (`LeanLayer`, `pack_layer`) -> the layers and final norm (`LeanStack`) ->
the causal LM with its rotary tables and LM head (`LeanDecoder`).

transformers' decoder layer runs about forty small kernels (RMSNorm alone is six, the rotary
embedding ten), and at a small target's size every one of them costs its launch, not its
arithmetic (docs/kernels.md, the lean decoder). `LeanDecoder` computes the same function with
fused operations:

    per layer:  rms_norm(+ residual)  ->  x · W_qkvᵀ  ->  rope_cache (q/k norm, rotation, K/V written)
                ->  tree_attention  ->  · W_oᵀ  ->  rms_norm(+ residual)  ->  x · W_gate_upᵀ
                ->  silu_mul  ->  · W_downᵀ          (nine launches)

The residual add of each block is fused into the next RMSNorm (`rms_norm(x, w, eps, residual)`
returns the sum too), so a layer's output, the feature the draft reads, is the `summed` of the
next norm. Rounding follows transformers' order step for step (each kernel's reference says how),
so in fp32 the logits equal the HF forward's up to the GEMMs' own summation order.

Weights. The decoder reads the HF model's parameters and never changes its modules: the norms,
W_o, W_down, the embedding and the LM head are the model's own tensors (shared storage). The q/k/v
and gate/up projections are one matrix each here (`W_qkv` [(Hq+2Hkv)·D, H], `W_gate_up` [2I, H]):
a view when the model already keeps the parts back to back in one storage, else a copy, which the
decoder owns. The copy would be (Hq+2Hkv)·D·H + 2·I·H elements a layer, a little over half of a
Llama / Qwen3 model's weights (4.5 B of Qwen3-8B's 8.2 B), so the target's loader lays the parts
back to back on CUDA (dominospec.target.share_storage) and the decoder then costs no
weight memory. Build it once per model and kind of ops, and share it (engine.runners.lean_decoder).

The KV cache is the caller's: keys and values [layers, Hkv, C, D] (`new_cache`). A forward of T
rows writes them at cache rows `slot .. slot+T-1` (a 0-d device tensor, so a CUDA graph reads it at
replay), at positions `slot + depth` (a tree's rows sit at their depth), and row i attends to every
cached row before `slot` and to this forward's rows j set in `visible[i]` (a bitmask, one int64 word
per 64 rows; `kernels.tree_attention`). A longer forward (a prompt) is one causal chain attended by
SDPA.

Features. A forward hands the output of every layer l to `tap.record(l, output [T, H])` (a
`dominospec.cache.tap.FeatureTap`: layer l's output is HF's `hidden_states[l + 1]`).

Imports: torch, transformers' modules through the model given, and dominospec.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen3")


# ----------------------------------------------------------------------------------------------
# The kernel seam
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderOps:
    """The fused operations a lean layer calls: the Triton kernels (`triton()`, CUDA) or their
    pure-torch references (`reference()`, any device: what the CPU tests hold against transformers).
    Each pair lives in one module of dominospec.kernels and computes the same function.

    rms_norm(x [T, H], w [H], eps, residual [T, H] | None) -> (normed [T, H], summed x + residual [T, H])
    rope_cache(qkv [T, (Hq+2Hkv) D], cos, sin [T, D], keys, values [Hkv, C, D], slot, Hq, Hkv,
               q_norm [D] | None, k_norm [D] | None, eps) -> q [T, Hq, D]; k, v written at rows slot..
    tree_attention(q [T, Hq, D], keys, values [Hkv, C, D], slot, visible [T, words], scale, workspace)
               -> [T, Hq, D]
    silu_mul(gate_up [T, 2I]) -> silu(gate) * up [T, I]
    workspace(T, Hq, Hkv, D, device) -> the attention's scratch for T rows (None: it needs none)
    """

    rms_norm: Callable
    rope_cache: Callable
    tree_attention: Callable
    silu_mul: Callable
    workspace: Callable
    name: str

    @staticmethod
    def triton() -> "DecoderOps":
        from dominospec.kernels import rms_norm, rope_cache, silu_mul, tree_attention

        return DecoderOps(rms_norm.rms_norm, rope_cache.rope_cache, tree_attention.tree_attention,
                          silu_mul.silu_mul, tree_attention.tree_attention_workspace, "triton")

    @staticmethod
    def reference() -> "DecoderOps":
        from dominospec.kernels import rms_norm, rope_cache, silu_mul, tree_attention

        def attention(q, k, v, start, visible, scale, workspace=None):
            return tree_attention.tree_attention_reference(q, k, v, start, visible, scale)

        return DecoderOps(rms_norm.rms_norm_reference, rope_cache.rope_cache_reference, attention,
                          silu_mul.silu_mul_reference, lambda *shape: None, "reference")

    @staticmethod
    def on(triton: bool) -> "DecoderOps":
        """The Triton kernels when `triton`, else the references."""
        return DecoderOps.triton() if triton else DecoderOps.reference()


def unsupported(model: Any) -> Optional[str]:
    """Why an HF causal LM cannot run on the lean decoder (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model_type {kind!r} (the lean decoder knows {list(SUPPORTED)})"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases in the attention or MLP projections"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if "dynamic" in str(rope_type) or "longrope" in str(rope_type):
        return f"RoPE type {rope_type!r} (its tables depend on the sequence length)"
    return None


# ----------------------------------------------------------------------------------------------
# One layer's weights
# ----------------------------------------------------------------------------------------------


@dataclass
class LeanLayer:
    """One pre-norm decoder layer's weights in the model's dtype: the module's own tensors, but for
    `qkv` and `gate_up` (`fused`)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: Optional[torch.Tensor]  # [D] (Qwen3), None (Llama)
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]


def fused(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Weights [out_i, in] of linears of one input -> [sum out_i, in]: a view when they lie back to
    back in one storage (no memory), else a copy (the decoder's own). The weights are not changed."""
    first, rows = weights[0], sum(w.shape[0] for w in weights)
    offset, adjacent = first.storage_offset(), True
    for w in weights:
        adjacent &= (w.is_contiguous() and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                     and w.storage_offset() == offset)
        offset += w.numel()
    with torch.no_grad():
        if adjacent:
            return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))
        return torch.cat([w.detach() for w in weights], dim=0)


def pack_layer(layer: Any) -> LeanLayer:
    """A pre-norm decoder layer (HF Llama / Qwen3, or the draft's) -> its LeanLayer."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LeanLayer(layer.input_layernorm.weight.detach(),
                     fused([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                     None if q_norm is None else q_norm.weight.detach(),
                     None if k_norm is None else k_norm.weight.detach(), attn.o_proj.weight.detach(),
                     layer.post_attention_layernorm.weight.detach(),
                     fused([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight.detach())


# ----------------------------------------------------------------------------------------------
# The layers
# ----------------------------------------------------------------------------------------------


class LeanStack:
    """Decoder layers on the fused ops, then the final norm: h [T, H] -> normed [T, H] (the target's,
    and the draft's backbone in lean_draft)."""

    def __init__(self, ops: DecoderOps, layers: list[LeanLayer], final_norm: torch.Tensor, Hq: int, Hkv: int, D: int,
                 eps: float):
        self.ops, self.layers, self.final_norm = ops, layers, final_norm
        self.Hq, self.Hkv, self.D, self.eps, self.scale = Hq, Hkv, D, eps, D ** -0.5

    def workspace_for(self, T: int, device: torch.device) -> Any:
        """The attention's scratch for forwards of T rows (one per runner and T: two launches in flight
        must not share it)."""
        return self.ops.workspace(T, self.Hq, self.Hkv, self.D, device)

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (keys, values), each [layers, Hkv, capacity, D], zeros."""
        shape = (len(self.layers), self.Hkv, capacity, self.D)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            slot: torch.Tensor, visible: Optional[torch.Tensor], tap: Any = None, chain_start: Optional[int] = None,
            workspace: Any = None, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h [T, H] at rotary tables cos/sin [T, D], its K/V written at cache rows slot.. -> final-normed
        [T, H]; the output of layer l goes to `tap.record(l, [T, H])` when a tap is given. Attention as
        `LeanDecoder.forward` says; `workspace` (`workspace_for(T)`) is its scratch, shared by the
        layers one after another.

        `context` [S, H] (the draft's appended rows, already normed): rows whose keys and values every
        layer writes at cache rows slot-S .. slot-1, projected in the same GEMM as the T rows' (one read
        of the q/k/v weights), their queries dropped; cos/sin then cover the S + T rows [S + T, D]."""
        T, S = h.shape[0], 0 if context is None else context.shape[0]
        first = slot - S if S else slot  # the cache row of the first row written
        residual = None
        for i, layer in enumerate(self.layers):
            x, summed = self.ops.rms_norm(h, layer.input_norm, self.eps, residual)
            if tap is not None and i > 0:
                tap.record(i - 1, summed)  # the previous layer's output (this layer's input)
            rows = torch.cat([context, x]) if S else x  # [S + T, H]
            q = self.ops.rope_cache(F.linear(rows, layer.qkv), cos, sin, keys[i], values[i], first, self.Hq, self.Hkv,
                                    layer.q_norm, layer.k_norm, self.eps)[S:]  # [T, Hq, D]
            if visible is not None:
                a = self.ops.tree_attention(q, keys[i], values[i], slot, visible, self.scale, workspace)
            else:
                a = self._chain_attention(q, keys[i], values[i], chain_start)
            x, residual = self.ops.rms_norm(F.linear(a.reshape(T, -1), layer.o), layer.post_norm, self.eps, summed)
            h = F.linear(self.ops.silu_mul(F.linear(x, layer.gate_up)), layer.down)  # the MLP's output [T, H]
        x, summed = self.ops.rms_norm(h, self.final_norm, self.eps, residual)
        if tap is not None:
            tap.record(len(self.layers) - 1, summed)
        return x

    def _chain_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """q [T, Hq, D] of a causal chain at cache rows start..start+T-1 -> [T, Hq, D], by SDPA (eager)."""
        T, groups = q.shape[0], self.Hq // self.Hkv
        k = keys[:, : start + T].repeat_interleave(groups, dim=0)[None]  # [1, Hq, S, D]
        v = values[:, : start + T].repeat_interleave(groups, dim=0)[None]
        rows = torch.arange(T, device=q.device)[:, None] + start
        mask = torch.arange(start + T, device=q.device)[None, :] <= rows  # [T, S]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=self.scale)
        return out[0].transpose(0, 1)  # [T, Hq, D]


# ----------------------------------------------------------------------------------------------
# The causal LM
# ----------------------------------------------------------------------------------------------


class LeanDecoder:
    """An HF Llama / Qwen3 causal LM -> its forward on fused ops and an explicit KV cache (module docstring)."""

    def __init__(self, model: Any, ops: DecoderOps):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"this model cannot run on the lean decoder: {reason}")
        config, decoder = model.config, model.base_model
        Hq = int(config.num_attention_heads)
        D = int(getattr(config, "head_dim", None) or config.hidden_size // Hq)
        self.stack = LeanStack(ops, [pack_layer(layer) for layer in decoder.layers], decoder.norm.weight.detach(), Hq,
                               int(config.num_key_value_heads), D, float(config.rms_norm_eps))
        self.ops, self.layers = ops, self.stack.layers
        self.rotary = decoder.rotary_emb
        self.embed = model.get_input_embeddings().weight.detach()  # [V, H]
        self.lm_head = model.get_output_embeddings().weight.detach()  # [V, H]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.cos = self.sin = torch.empty(0, D, dtype=self.dtype, device=self.device)  # rotary tables [positions, D]
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown tables, which captured graphs still read
        self.ensure_positions(int(config.max_position_embeddings))

    def ensure_positions(self, n: int) -> None:
        """Rotary tables for positions 0..n-1, computed once by the model's own `rotary_emb` (any RoPE
        type whose tables depend on the position alone, elementwise: a row of the table is what a forward
        at that position computes): a forward then gathers its rows, two launches instead of the tables'
        seven. Every runner on this decoder shares them and a captured graph holds their addresses:
        outgrown tables are kept (`retired`)."""
        if self.cos.shape[0] >= n:
            return
        probe = torch.empty(1, 1, 1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = self.rotary(probe, torch.arange(n, device=self.device)[None])  # [1, n, D]
        if self.cos.shape[0]:
            self.retired.append((self.cos, self.sin))
        self.cos, self.sin = cos[0], sin[0]

    def new_cache(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (keys, values), each [layers, Hkv, capacity, D], zeros."""
        return self.stack.new_cache(capacity, self.dtype, self.device)

    def forward(self, ids: torch.Tensor, slot: torch.Tensor, depth: torch.Tensor, visible: Optional[torch.Tensor],
                keys: torch.Tensor, values: torch.Tensor, keep: int, tap: Any = None,
                chain_start: Optional[int] = None, workspace: Any = None) -> torch.Tensor:
        """ids [T] written at cache rows slot..slot+T-1, positions slot + depth [T] -> logits [keep, V]
        of the last `keep` rows; every layer's output [T, H] to `tap.record` (module docstring).

        visible [T, words] int64: row i sees cache rows < slot and this forward's rows j with bit j
        set; only tensor ops on device tensors (capturable). visible None: the rows are one causal
        chain at host position `chain_start` (== slot), any T, eager (a prompt)."""
        T = ids.shape[0]
        h = F.embedding(ids, self.embed)  # [T, H]
        positions = slot + depth  # [T], < the tables' rows (the engine stops at max_position_embeddings)
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # [T, D] each
        x = self.stack.run(h, cos, sin, keys, values, slot, visible, tap, chain_start, workspace)
        return F.linear(x[T - keep:], self.lm_head)  # [keep, V]
