"""The target's forward in nine launches a layer: a lean decoder for Llama / Qwen3-family targets at batch 1.

transformers' decoder layer runs about forty small kernels (RMSNorm alone is six, the rotary
embedding ten), and at SmolLM2's size every one of them costs its launch, not its arithmetic: on
an H200 a one-row step's device time was almost all gaps between kernels (docs/kernels.md, the
lean decoder). `LeanDecoder` computes the same function with fused operations:

    per layer:  rms_norm(+ residual)  ->  x · W_qkvᵀ  ->  rope_cache (q/k norm, rotation, K/V written)
                ->  tree_attention  ->  · W_oᵀ  ->  rms_norm(+ residual)  ->  x · W_gate_upᵀ
                ->  silu_mul  ->  · W_downᵀ          (nine launches)

The residual add of each block is fused into the next RMSNorm (`rms_norm(x, w, eps, residual)`
returns the sum too), so a layer's output, the feature the draft reads, is the `summed` of the
next norm. Rounding follows transformers' order step for step (each kernel's reference says how),
so in fp32 the logits equal the HF forward's up to the GEMMs' own summation order.

Weights: the q/k/v and gate/up projections become one matrix each (`W_qkv` [(Hq+2Hkv)·D, H],
`W_gate_up` [2I, H]); the HF modules' weights are rebound as views of them, so the model keeps
working and no weight is held twice. The rotary tables come from the model's own `rotary_emb`
(any RoPE type whose tables depend on the position alone).

The KV cache is ours: keys and values [layers, Hkv, C, D]. A forward of T rows writes them at
cache rows `slot .. slot+T-1` (a 0-d device tensor, so a CUDA graph reads it at replay), at
positions `slot + depth` (a tree's rows sit at their depth), and row i attends to every cached row
before `slot` and to this forward's rows j set in `visible[i]` (a bitmask, T <= 64;
`kernels.tree_attention`). A longer forward (a prompt) is one causal chain attended by SDPA.

Ops: the Triton kernels on CUDA (`DecoderOps.triton()`), their pure-torch references elsewhere
(`DecoderOps.reference()`: the CPU tests run the same forward against the HF model).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from dominospec.errors import UserError

_BUILT: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # module -> {ops kind: built}
SUPPORTED = ("llama", "qwen3")


@dataclass(frozen=True)
class DecoderOps:
    """The four fused operations a lean layer calls (dominospec.kernels.*: each a Triton kernel beside its reference)."""

    rms_norm: Callable
    rope_cache: Callable
    tree_attention: Callable  # (q, k, v, start, visible, scale, workspace)
    silu_mul: Callable
    workspace: Callable  # (T, Hq, Hkv, D, device) -> the attention's scratch for T rows (None: it needs none)
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


@dataclass
class LeanLayer:
    """One decoder layer's weights, in the model's dtype (views of the HF modules' storage)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    q_norm: Optional[torch.Tensor]  # [D] (Qwen3), None (Llama)
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]


def unsupported(model: Any) -> Optional[str]:
    """Why `model` cannot run on the lean decoder (None: it can)."""
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


class LeanStack:
    """Decoder layers on the fused ops, then the final norm: h [T, H] -> normed [T, H] (and tapped layer outputs)."""

    def __init__(self, ops: DecoderOps, layers: list[LeanLayer], final_norm: torch.Tensor, Hq: int, Hkv: int, D: int,
                 eps: float):
        self.ops, self.layers, self.final_norm = ops, layers, final_norm
        self.Hq, self.Hkv, self.D, self.eps, self.scale = Hq, Hkv, D, eps, D ** -0.5

    def workspace_for(self, T: int, device: torch.device) -> Any:
        """The attention's scratch for forwards of T rows (one per runner and T: two launches in flight must not share it)."""
        return self.ops.workspace(T, self.Hq, self.Hkv, self.D, device)

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (keys, values), each [layers, Hkv, capacity, D], zeros."""
        shape = (len(self.layers), self.Hkv, capacity, self.D)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            slot: torch.Tensor, visible: Optional[torch.Tensor], taps: Sequence[int] = (),
            chain_start: Optional[int] = None, workspace: Any = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """h [T, H] at rotary tables cos/sin [T, D], its K/V written at cache rows slot.. -> (final-normed
        [T, H], cat(output of layer l for l in taps) [T, n H] or None). Attention as `LeanDecoder.forward`
        says; `workspace` (`workspace_for(T)`) is its scratch, shared by the layers one after another."""
        T = h.shape[0]
        outputs: dict[int, torch.Tensor] = {}
        residual = None
        for i, layer in enumerate(self.layers):
            x, summed = self.ops.rms_norm(h, layer.input_norm, self.eps, residual)
            if i - 1 in taps:
                outputs[i - 1] = summed  # the previous layer's output (this layer's input)
            q = self.ops.rope_cache(F.linear(x, layer.qkv), cos, sin, keys[i], values[i], slot, self.Hq, self.Hkv,
                                    layer.q_norm, layer.k_norm, self.eps)  # [T, Hq, D]
            if visible is not None:
                a = self.ops.tree_attention(q, keys[i], values[i], slot, visible, self.scale, workspace)
            else:
                a = self._chain_attention(q, keys[i], values[i], chain_start)
            x, residual = self.ops.rms_norm(F.linear(a.reshape(T, -1), layer.o), layer.post_norm, self.eps, summed)
            h = F.linear(self.ops.silu_mul(F.linear(x, layer.gate_up)), layer.down)  # the MLP's output [T, H]
        x, summed = self.ops.rms_norm(h, self.final_norm, self.eps, residual)
        outputs[len(self.layers) - 1] = summed
        return x, (torch.cat([outputs[l] for l in taps], dim=-1) if taps else None)

    def _chain_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """q [T, Hq, D] of a causal chain at cache rows start..start+T-1 -> [T, Hq, D], by SDPA (eager)."""
        T, groups = q.shape[0], self.Hq // self.Hkv
        k = keys[:, : start + T].repeat_interleave(groups, dim=0)[None]  # [1, Hq, S, D]
        v = values[:, : start + T].repeat_interleave(groups, dim=0)[None]
        rows = torch.arange(T, device=q.device)[:, None] + start
        mask = torch.arange(start + T, device=q.device)[None, :] <= rows  # [T, S]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=self.scale)
        return out[0].transpose(0, 1)  # [T, Hq, D]


class LeanDecoder:
    """An HF Llama / Qwen3 causal LM -> its forward on fused ops and an explicit KV cache (module docstring)."""

    def __init__(self, model: Any, ops: DecoderOps):
        reason = unsupported(model)
        if reason is not None:
            raise UserError(f"engine.lean_target: this target cannot run on the lean decoder: {reason}")
        config, decoder = model.config, model.get_decoder()
        Hq = int(config.num_attention_heads)
        D = int(getattr(config, "head_dim", None) or config.hidden_size // Hq)
        self.stack = LeanStack(ops, [pack_layer(layer) for layer in decoder.layers], decoder.norm.weight, Hq,
                               int(config.num_key_value_heads), D, float(config.rms_norm_eps))
        self.ops, self.layers = ops, self.stack.layers
        self.rotary = decoder.rotary_emb
        self.embed = model.get_input_embeddings().weight  # [V, H]
        self.lm_head = model.get_output_embeddings().weight  # [V, H]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.cos = self.sin = torch.empty(0, D, dtype=self.dtype, device=self.device)  # rotary tables [positions, D]
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown tables, which captured graphs still read
        self.ensure_positions(int(config.max_position_embeddings))

    def ensure_positions(self, n: int) -> None:
        """Rotary tables for positions 0..n-1, computed once by the model's own `rotary_emb` (elementwise
        in the position, so a row of the table is what a forward at that position computes): a forward
        then gathers its rows, two launches instead of the tables' seven. Every runner on this decoder
        shares them and a captured graph holds their addresses: outgrown tables are kept (`retired`)."""
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
                keys: torch.Tensor, values: torch.Tensor, keep: int, taps: Sequence[int] = (),
                chain_start: Optional[int] = None, workspace: Any = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """ids [T] written at cache rows slot..slot+T-1, positions slot + depth [T] -> (logits [keep, V]
        of the last `keep` rows, features [T, n H] = cat(output of layer l for l in taps) or None).

        visible [T] int64 (T <= 64): row i sees cache rows < slot and this forward's rows j with bit j
        set; only tensor ops on device tensors (capturable). visible None: the rows are one causal
        chain at host position `chain_start` (== slot), any T, eager (a prompt)."""
        T = ids.shape[0]
        h = F.embedding(ids, self.embed)  # [T, H]
        positions = slot + depth  # [T], < the tables' rows (the engine stops at max_position_embeddings)
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # [T, D] each
        x, features = self.stack.run(h, cos, sin, keys, values, slot, visible, taps, chain_start, workspace)
        return F.linear(x[T - keep:], self.lm_head), features  # [keep, V]


def pack_layer(layer: Any) -> LeanLayer:
    """A pre-norm decoder layer (HF Llama / Qwen3, or the draft's) -> its LeanLayer: q/k/v and gate/up
    concatenated into one matrix each, the modules' weights rebound as views of them."""
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LeanLayer(layer.input_layernorm.weight, qkv, None if q_norm is None else q_norm.weight,
                     None if k_norm is None else k_norm.weight, attn.o_proj.weight,
                     layer.post_attention_layernorm.weight, gate_up, mlp.down_proj.weight)


def _fuse(linears: Sequence[torch.nn.Linear]) -> torch.Tensor:
    """Linears of one input -> their weights stacked [sum out, in]; each module's weight becomes a view of it."""
    fused = torch.cat([m.weight.detach() for m in linears], dim=0)
    first = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[first:first + rows], requires_grad=False)
        first += rows
    return fused


def lean_decoder(model: Any, triton: bool) -> LeanDecoder:
    """The model's lean decoder (built once per model and kind of ops, then shared by its engines)."""
    return built_once(model, triton, LeanDecoder)


def built_once(module: Any, triton: bool, build: Callable[[Any, DecoderOps], Any]) -> Any:
    """build(module, ops) for the Triton ops or their references, kept on the module: its weights are
    packed (rebound) once, and every engine on it shares the result."""
    cached = _BUILT.setdefault(module, {})  # beside the module, not on it: a deepcopy (another dtype) builds anew
    kind = "triton" if triton else "reference"
    if kind not in cached:
        cached[kind] = build(module, DecoderOps.triton() if triton else DecoderOps.reference())
    return cached[kind]
