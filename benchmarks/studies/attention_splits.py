"""The lean decoder's tree attention at a target shape, by its launch knobs: query rows a tile
(block_m), column-block size (block_n), the warps of a program, and the splits per (kv head, tile);
the fewest blocks a split takes (min_span) stays at its default, 4 (the best of 1 / 2 / 4 before).

One layer's attention of T rows over `--context` cached rows, 36 calls captured in one CUDA graph
(a model's layers), replayed; µs a call = the replay's device time ÷ 36. The default row of each T
is what the lean runner uses today (kernels.tree_attention's defaults).

    python benchmarks/studies/attention_splits.py --out attention_splits.json   # CUDA
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

import argparse
import itertools
import statistics

import torch
import triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--block-n", default="16,32,64", help="column blocks to try")
    ap.add_argument("--warps", default="4,8", help="num_warps to try")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from common.record import environment, write_json
    from common.timing import log
    from dominospec.kernels.tree_attention import causal_bits, default_splits, tree_attention, tree_attention_workspace

    device, dtype = torch.device("cuda"), torch.bfloat16
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    out = dict(**environment(True), shape=dict(heads=Hq, kv_heads=Hkv, head_dim=D, context=args.context), rows={})
    for T in [int(t) for t in args.rows.split(",")]:
        C = args.context + T
        k = torch.randn(Hkv, C, D, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(T, Hq, D, device=device, dtype=dtype)
        start = torch.tensor(args.context, device=device)
        bits = causal_bits(T, device)
        default = tree_attention_workspace(T, Hq, Hkv, D, device)
        tiles = {m for m in (16, 32, 64, 128) if m <= max(16, triton.next_power_of_2(T * Hq // Hkv))}
        configs = [("default", default.block_m, default.block_n, default.num_warps, default.splits)] + [
            (f"m {m}, n {n}, warps {w}, splits {x}", m, n, w, x)
            for m, n, w in itertools.product(sorted(tiles), ints(args.block_n), ints(args.warps))
            for x in sorted({max(1, default_splits(T, Hq, Hkv, device, m) // 2), default_splits(T, Hq, Hkv, device, m)})]
        reference = None
        for name, block_m, block_n, warps, splits in configs:
            ws = tree_attention_workspace(T, Hq, Hkv, D, device, splits=min(64, splits), block_m=block_m,
                                          block_n=block_n, num_warps=warps)
            try:
                got = tree_attention(q, k, v, start, bits, D ** -0.5, ws)
            except Exception as e:  # a tile that does not fit the shared memory, say
                log(f"T={T} {name}: {type(e).__name__}")
                continue
            reference = got if reference is None else reference
            ok = bool(torch.allclose(got.float(), reference.float(), atol=2e-2, rtol=0))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.layers):
                    tree_attention(q, k, v, start, bits, D ** -0.5, ws)
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / (10 * args.layers))
            us = statistics.median(times)
            out["rows"].setdefault(str(T), {})[name] = dict(us=us, block_m=block_m, block_n=block_n, num_warps=warps,
                                                            splits=splits, same_as_default=ok)
            log(f"T={T} {name}: {us:.1f} µs a layer{'' if ok else ' (DIFFERS)'}")
            write_json(args.out, out)
    lines = [f"\n{out['device']}, {out['date']}; Hq {Hq}, Hkv {Hkv}, D {D}, context {args.context}, bf16", "",
             "| rows | default µs | best µs | best config |", "|---|---|---|---|"]
    for T, by in out["rows"].items():
        best = min(by.items(), key=lambda kv: kv[1]["us"])
        lines.append(f"| {T} | {by['default']['us']:.1f} | {best[1]['us']:.1f} | {best[0]} |")
    print("\n".join(lines))


def ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


if __name__ == "__main__":
    main()
