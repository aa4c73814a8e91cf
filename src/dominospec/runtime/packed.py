"""Linear layers with weights packed once for oneDNN (CPU): the engine's `linear: packed` switch.

In fp32 `F.linear` goes through MKL, which re-packs the weight on every call of more than one row (an
8-row verify cost well over one AR step on the 2-core EPYC: docs/journal/2026-11-30-speculative-decoding-
cost-on-cpu.md); oneDNN with a weight packed once runs 1..8 rows at about the cost of one. `pack_linears`
swaps every packable `nn.Linear` for a `PackedLinear` (the original `weight` stays reachable, e.g. tied).
"""

from __future__ import annotations

import torch
from torch import nn

PACKABLE = (torch.float32, torch.bfloat16)


def packable(weight: torch.Tensor) -> bool:
    """A weight oneDNN can pack here: CPU, fp32 or bf16, and the mkldnn ops present."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W [out, in] packed once for oneDNN; x [..., in] -> y [..., out] in W's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 8):
        super().__init__()
        weight = weight.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight  # the unpacked original (plain attribute: not a parameter, not in state_dict)
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)  # opaque oneDNN layout

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype | None = None) -> "PackedLinear":
        """nn.Linear (optionally cast to `dtype`) -> PackedLinear of the same function."""
        dtype = dtype or linear.weight.dtype
        bias = None if linear.bias is None else linear.bias.to(dtype)
        return cls(linear.weight.to(dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}"


def pack_linears(module: nn.Module) -> int:
    """Swap every packable nn.Linear inside `module` (in place) for a PackedLinear -> how many were swapped."""
    swapped = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and packable(child.weight):
            setattr(module, name, PackedLinear.from_linear(child))
            swapped += 1
        else:
            swapped += pack_linears(child)
    return swapped


def unpack_linears(module: nn.Module) -> int:
    """Undo `pack_linears` in place: every PackedLinear becomes an nn.Linear on the same weight
    tensor (no copy, so a tied embedding stays tied) -> how many were swapped back."""
    swapped = 0
    for name, child in list(module.named_children()):
        if isinstance(child, PackedLinear):
            plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            plain.weight = nn.Parameter(child.weight, requires_grad=False)
            if child.bias is not None:
                plain.bias = nn.Parameter(child.bias, requires_grad=False)
            setattr(module, name, plain)
            swapped += 1
        else:
            swapped += unpack_linears(child)
    return swapped


def linear_for(linear: nn.Module, dtype: torch.dtype, packed: bool) -> nn.Module:
    """A linear layer (nn.Linear or PackedLinear) -> the same function in `dtype`, packed when asked and possible."""
    weight = linear.weight.detach().to(dtype)
    bias = None if getattr(linear, "bias", None) is None else linear.bias.detach().to(dtype)
    if packed and packable(weight):
        return PackedLinear(weight, bias)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out.requires_grad_(False)
