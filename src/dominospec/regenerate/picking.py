"""The static decoder's next-token pick: greedy, or a draw that depends on the reply alone.

    pick(logits [B, V], temperature [B], seeds [B], steps [B], top_p, sampled) -> tokens [B]

A row with temperature 0 takes the argmax (the first of equal maxima, as today's decoder). A row
with temperature t > 0 draws from softmax(logits / t) (after `top_p`, HF's order) by inverse CDF at
one uniform u = counter_uniform(seed, step): a counter-based hash of the reply's seed and the index
of the token in the reply. So a sampled reply is a function of its seed and the target's logits,
whatever rows share its batch, whichever slot it runs in and whether its run was resumed; and the
pick is tensor ops only (capturable in a CUDA graph, no generator state). `sampled` False skips
the sampling ops (a batch of greedy rows only).

The hash is Chris Wellons' lowbias32 on 32-bit words held in int64, with each product split into
16-bit halves so that no int64 operation overflows; u keeps 23 bits (tokens below ~1e-7 of the
mass are never drawn).
"""

from __future__ import annotations

import torch

from dominospec.regenerate.decoder import top_p_filter

_MASK = 0xFFFFFFFF


def pick(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, top_p: float,
         sampled: bool) -> torch.Tensor:
    """logits [B, V] float32, temperature [B] (0: greedy), seeds [B], steps [B] int64 -> next tokens [B] int64."""
    greedy = logits.argmax(-1)
    if not sampled:
        return greedy
    hot = temperature > 0
    scaled = logits / torch.where(hot, temperature, torch.ones_like(temperature))[:, None]
    cdf = top_p_filter(scaled, top_p).softmax(-1).cumsum(-1)  # [B, V]
    u = counter_uniform(seeds, steps)[:, None] * cdf[:, -1:]  # [B, 1], within the rounded total mass
    drawn = torch.searchsorted(cdf, u).squeeze(1).clamp_(max=logits.shape[1] - 1)
    return torch.where(hot, drawn, greedy)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds [B], steps [B] int64 (any values) -> uniforms [B] float32 in (0, 1), a hash of the pair."""
    x = _mix((_mix(seeds & _MASK) + _mul32(steps & _MASK, 0x9E3779B9)) & _MASK)
    return ((x >> 9).float() + 0.5) / float(1 << 23)


def seed_of(*parts: object) -> int:
    """Any parts (the run's seed, a reply's id) -> a 31-bit seed, stable across runs and machines."""
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "big") >> 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow."""
    return (((x & 0xFFFF) * c) + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a 32-bit word -> a well-mixed 32-bit word."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
