"""The target's forward for many independent sequences at once, on one static KV cache.

    keys / values    [L, S, Hkv, C, D]   slot s holds its sequence's keys and values in columns
                                         [0, length_s); nothing is ever moved but by `move`
    decode(ids [B], positions [B], cols, seen [B]) -> logits [B, V]
        rows 0..B-1 are slots 0..B-1, one token each at its own position; each row's K/V is written at
        column `position`, then the row attends to its columns [0, seen) (default position + 1)
    prefill(slots [n], ids [n, T], lengths [n]) -> logits [n, V] of each row's last real token
        fresh sequences, right-padded to T: each row attends causally to its own tokens (the padding
        is after them, so no real row sees it); its K/V fill the slot's columns [0, T)

The weights, the rotary tables and the fused operations are the lean decoder's (models.lean:
`LeanLayer`, `DecoderOps`: the Triton kernels on CUDA, their pure-torch references elsewhere), so
the arithmetic is that decoder's, in transformers' rounding order; only the attention differs:
prefills use `gqa_sdpa`, and decode steps one of two attentions (`attention`):

    rows     `kernels.decode_attention`: each row reads its own `seen` columns and no more, in one
             Triton launch whose grid depends on B only (CUDA, or TRITON_INTERPRET=1 on the CPU)
    padded   `runtime.attention.gqa_one_query` (the one-query grouped attention today's slot decoder
             steps with) over the columns [0, cols) of every row, masked past each row's position:
             every row pays for the longest, and the [B, Hkv, cols, D] prefix views are copied
             before the batched matmuls On the CPU every linear layer runs on a weight packed once
for oneDNN (`runtime.packed.PackedLinear`: MKL would re-pack it on every call of more than one row). Every op of `decode` is a tensor op on device tensors
whose shapes depend on (B, cols) only: one decode step is capturable in a CUDA graph per (B, cols).
With `padded` the attention's cost follows `cols`, not the capacity C: the caller picks the smallest
column bucket that holds the longest row. With `rows` it follows each row's own length; `cols` is
not read.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dominospec.runtime.attention import gqa_one_query, gqa_sdpa
from dominospec.runtime.packed import PackedLinear, packable
from dominospec.models.lean import LeanDecoder

ATTENTIONS = ("rows", "padded")  # decode attention: each row's own columns (Triton) | every row over [0, cols) (torch)


def resolve_attention(choice: str, device: torch.device) -> str:
    """regenerate.attention (auto | rows | padded) on `device` -> rows | padded: auto = rows on CUDA; rows
    needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)."""
    if choice == "auto":
        return "rows" if device.type == "cuda" else "padded"
    if choice == "rows" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("regenerate.attention: rows runs a Triton kernel: it needs CUDA, or TRITON_INTERPRET=1 "
                         f"on a {device.type} device (slow; padded is the CPU's fastest)")
    return choice


class BatchForward:
    """An HF Llama / Qwen3 target on S slots of C columns (module docstring)."""

    def __init__(self, decoder: LeanDecoder, slots: int, capacity: int, attention: str = "padded"):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.attention = attention
        if attention == "rows":  # triton is imported only when used (TRITON_INTERPRET=1 must come first on a CPU)
            from dominospec.kernels.decode_attention import decode_attention

            self._decode_attention = decode_attention
        self.rows_knobs: dict[str, int] = {}  # rows: the kernel's block_n / num_warps, if not its defaults
        stack = decoder.stack
        self.decoder, self.stack, self.ops = decoder, stack, decoder.ops
        self.Hq, self.Hkv, self.D = stack.Hq, stack.Hkv, stack.D
        self.slots, self.capacity = slots, capacity
        decoder.ensure_positions(capacity)
        shape = (len(stack.layers), slots, self.Hkv, capacity, self.D)
        self.keys = torch.zeros(shape, dtype=decoder.dtype, device=decoder.device)  # [L, S, Hkv, C, D]
        self.values = torch.zeros_like(self.keys)
        self.device, self.dtype = decoder.device, decoder.dtype
        # per layer (qkv, o, gate_up, down), then the LM head: x [N, in] -> [N, out]
        self.linears = [[_linear(w, slots) for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
                        for layer in stack.layers]
        self.lm_head = _linear(decoder.lm_head, slots)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cols: int,
               seen: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B], positions [B] (< cols, < C) of slots 0..B-1, seen [B] (<= position + 1; default
        position + 1) -> logits [B, V] float32 (module docstring)."""
        B = ids.shape[0]
        rows = torch.arange(B, device=self.device)
        # the flat (slot, kv head, column) index of each row's new K/V in a layer's [S * Hkv * C, D] view
        heads = torch.arange(self.Hkv, device=self.device)
        at = ((rows[:, None] * self.Hkv + heads[None, :]) * self.capacity + positions[:, None]).reshape(-1)  # [B*Hkv]
        if self.attention == "rows":
            seen = positions + 1 if seen is None else seen  # [B] columns each row reads
        else:
            last = positions if seen is None else seen - 1  # [B] the last column each row reads
            allowed = torch.arange(cols, device=self.device)[None, :] <= last[:, None]  # [B, cols]
            mask = torch.zeros(B, 1, 1, cols, dtype=self.dtype, device=self.device).masked_fill_(
                ~allowed[:, None, None], float("-inf"))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [B, Hq, D], k/v [B, Hkv, D] -> [B, Hq * D]
            self._write(layer, at, k.reshape(B * self.Hkv, self.D), v.reshape(B * self.Hkv, self.D))
            if self.attention == "rows":
                out = self._decode_attention(q, self.keys[layer], self.values[layer], seen, self.stack.scale,
                                             **self.rows_knobs)  # [B, Hq, D]
            else:
                keys, values = self.keys[layer, :B, :, :cols], self.values[layer, :B, :, :cols]  # [B, Hkv, cols, D] views
                out = gqa_one_query(q[:, :, None], keys, values, mask, self.stack.scale)  # [B, 1, Hq, D]
            return out.reshape(B, self.Hq * self.D)

        x = self._layers(F.embedding(ids, self.decoder.embed), positions, attend)  # [B, H]
        return self.lm_head(x).float()

    def prefill(self, slots: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """slots [n], ids [n, T] right-padded, lengths [n] (>= 1) -> logits [n, V] float32 of each row's
        last real token; the rows' K/V go to their slots' columns [0, T)."""
        n, T = ids.shape
        heads = torch.arange(self.Hkv, device=self.device)
        columns = torch.arange(T, device=self.device)
        at = ((slots[:, None, None] * self.Hkv + heads[None, :, None]) * self.capacity + columns).reshape(-1)  # [n*Hkv*T]
        positions = columns.repeat(n)  # [n*T]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [n*T, Hq, D], k/v [n*T, Hkv, D] -> [n*T, Hq * D]
            q, k, v = (t.reshape(n, T, -1, self.D).transpose(1, 2) for t in (q, k, v))  # [n, heads, T, D]
            self._write(layer, at, k.reshape(-1, self.D), v.reshape(-1, self.D))
            out = gqa_sdpa(q, k, v, None, self.stack.scale, causal=True)  # [n, Hq, T, D]
            return out.transpose(1, 2).reshape(n * T, self.Hq * self.D)

        x = self._layers(F.embedding(ids.reshape(-1), self.decoder.embed), positions, attend)  # [n*T, H]
        last = torch.arange(n, device=self.device) * T + lengths - 1
        return self.lm_head(x.index_select(0, last)).float()

    def move(self, sources: torch.Tensor, targets: torch.Tensor, cols: int) -> None:
        """Copy slots `sources` [m] to slots `targets` [m] (columns [0, cols)), every layer."""
        for cache in (self.keys, self.values):
            cache[:, targets, :, :cols] = cache[:, sources, :, :cols]

    def _write(self, layer: int, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, D] -> the flat rows `at` [N] of the layer's [S * Hkv * C, D] view (index_copy_: capturable)."""
        self.keys[layer].view(-1, self.D).index_copy_(0, at, k)
        self.values[layer].view(-1, self.D).index_copy_(0, at, v)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """h [N, H] at positions [N] -> the final-normed [N, H]; `attend(layer, q, k, v)` writes the K/V
        and returns the attention output. The layer's arithmetic is models.lean's in HF's order."""
        ops, stack, Hq, Hkv, D, eps = self.ops, self.stack, self.Hq, self.Hkv, self.D, self.stack.eps
        cos = self.decoder.cos.index_select(0, positions)[:, None]  # [N, 1, D]
        sin = self.decoder.sin.index_select(0, positions)[:, None]
        N, residual = h.shape[0], None
        for i, layer in enumerate(stack.layers):
            qkv, o, gate_up, down = self.linears[i]
            x, summed = ops.rms_norm(h, layer.input_norm, eps, residual)
            q, k, v = qkv(x).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = q.reshape(N, Hq, D), k.reshape(N, Hkv, D), v.reshape(N, Hkv, D)
            if layer.q_norm is not None:  # Qwen3: RMSNorm over each head, before the rotation
                q = ops.rms_norm(q.reshape(-1, D), layer.q_norm, eps)[0].reshape(N, Hq, D)
                k = ops.rms_norm(k.reshape(-1, D), layer.k_norm, eps)[0].reshape(N, Hkv, D)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin  # HF's apply_rotary_pos_emb
            a = attend(i, q, k, v.contiguous())
            x, residual = ops.rms_norm(o(a), layer.post_norm, eps, summed)
            h = down(ops.silu_mul(gate_up(x)))
        return ops.rms_norm(h, stack.final_norm, eps, residual)[0]


def _linear(weight: torch.Tensor, rows: int):
    """A weight [out, in] -> x [N, in] -> x · weightᵀ: packed once for oneDNN where it can be (CPU fp32/bf16)."""
    if packable(weight):
        return PackedLinear(weight, rows_hint=rows)
    return lambda x: F.linear(x, weight)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1] (x1, x2 the halves of the last dim), as transformers' `rotate_half`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
