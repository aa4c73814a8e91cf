"""bf16 against fp32 on this CPU: one-row linears of the draft's and the target's shapes, and what `auto` picks.

The dtype keys' `auto` (dominospec.precision) picks bf16 on a CPU only where it has native bf16.
This shows why: on an AVX512-BF16 host bf16 runs these linears about 2x faster, on one capped at
AVX2 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`, or a CPU without the flags) about 4x slower.

    python benchmarks/bf16_linear.py [--threads 2]

The last line printed is a markdown table: µs a call (best of 7 runs of 50 calls) in each dtype.
"""

from __future__ import annotations

import argparse
import time

import torch

from dominospec.precision import resolve_dtype

SHAPES = {"draft MLP up [16, 576] x [576, 1536]": (16, 576, 1536),
          "target q/o [1, 576] x [576, 576]": (1, 576, 576),
          "lm head [16, 576] x [576, 49152]": (16, 576, 49152)}


def best_us(rows: int, inner: int, outer: int, dtype: torch.dtype, calls: int = 50) -> float:
    """-> the best of 7 runs' µs a call of F.linear([rows, inner], [outer, inner]) in `dtype`."""
    x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(outer, inner, dtype=dtype)
    torch.nn.functional.linear(x, w)  # oneDNN builds its kernel on the first call
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            torch.nn.functional.linear(x, w)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()}, "
          f"auto -> {resolve_dtype('auto', 'cpu')}")
    print("| linear | fp32 µs | bf16 µs | bf16 / fp32 |\n|---|---|---|---|")
    for name, shape in SHAPES.items():
        fp32, bf16 = best_us(*shape, torch.float32), best_us(*shape, torch.bfloat16)
        print(f"| {name} | {fp32:.0f} | {bf16:.0f} | {bf16 / fp32:.2f} |")


if __name__ == "__main__":
    main()
