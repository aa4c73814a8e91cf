"""bfloat16 where this machine runs it fast: what `auto` means in the dtype and precision params.

A CPU without native bf16 arithmetic (no AVX512-BF16 or AMX) emulates it. There a linear of the
draft's shape, [16, 576] x [576, 1536], runs about 4.6x slower in bf16 than in fp32 (one thread, the
host capped at AVX2), while the same AVX512-BF16 host uncapped runs it 2.2x faster (docs/design.md §6).
So `auto` is bf16 on CUDA, and on a CPU only where it has native bf16 and nothing caps the ISA
below it: the keys regenerate.dtype, cache.compute_dtype, train.precision and engine.draft_dtype.
Measured by benchmarks/bf16_linear.py.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

AUTO = "auto"


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still include its native bf16 kernels
BF16_ISAS = {"ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16"}


@functools.lru_cache(maxsize=None)
def bf16_is_fast(device_type: str) -> bool:
    """device_type ("cpu" | "cuda" | ...) -> whether bf16 matmuls beat fp32 ones there. CUDA: yes. CPU: when
    it has native bf16 (AVX512-BF16 or AMX) and neither ATen (ATEN_CPU_CAPABILITY) nor oneDNN
    (ONEDNN_MAX_CPU_ISA) is capped below it. A flag, not a timing: timings flip on a loaded host."""
    if device_type != "cpu":
        return device_type == "cuda"
    native = any(getattr(torch.cpu, probe, lambda: False)() for probe in
                 ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    aten = torch.backends.cpu.get_cpu_capability() == "AVX512"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in BF16_ISAS
    return native and aten and onednn


def resolve_dtype(name: Optional[str], device: torch.device | str) -> Optional[str]:
    """A dtype key's value -> itself, or for `auto` "bfloat16" where bf16 is fast on `device`, else "float32"."""
    if name != AUTO:
        return name
    return "bfloat16" if bf16_is_fast(torch.device(device).type) else "float32"


def resolve_precision(precision: str, accelerator: str) -> str:
    """train.precision -> itself, or for `auto` Lightning's "bf16-mixed" where bf16 is fast on the
    accelerator the trainer will use (auto: CUDA when present), else "32-true"."""
    if precision != AUTO:
        return precision
    device = "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu"
    return "bf16-mixed" if bf16_is_fast(device) else "32-true"


def dtype_name(model: torch.nn.Module) -> str:
    """-> the dtype `model` computes in, as the params write it ("bfloat16"): what `auto` became, for reports."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")
