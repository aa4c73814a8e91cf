"""DominoTree's build on one GPU: the torch ops against the kernels (kernels.tree_grow), by node budget.

Both run the engine's `TreeGrower` as one CUDA graph per K (what a round replays), on random head
weights of a named draft shape (a build's cost does not depend on the weights' values), in bf16 with
the candidate pool. Per shape and budget: device ms a build (CUDA events over a run of replays, the
median of --reps runs), interleaved build by build, and how many of the kernels' nodes the torch
build also chose (bf16: the two may part at a near-tie). `--score-cols 16,64` times the kernels again
with those score programs' pool columns (the default's rule: kernels.tree_grow.score_split).

    python benchmarks/tree_build.py --out tree_build.json            # CUDA
    python benchmarks/tree_build.py --smoke --out /tmp/tree_build.json  # CPU, TRITON_INTERPRET=1, tiny shape

Shapes: smollm2-h200 (the shared draft: V 49,152, H 576, G 256, r 64, B 8) and qwen3-8b (the
preset's draft: V 151,936, H 4,096, G 1,024, r 256, B 16); P = 1, pool 2,048, 4 children.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

SHAPES = {  # V, H, G, r, block size
    "smollm2-h200": (49152, 576, 256, 64, 8),
    "qwen3-8b": (151936, 4096, 1024, 256, 16),
    "smoke": (300, 24, 16, 8, 5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-h200,qwen3-8b")
    ap.add_argument("--budgets", default="16,32,64,128,256")
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--pool", type=int, default=2048)
    ap.add_argument("--replays", type=int, default=50, help="builds a timed run")
    ap.add_argument("--reps", type=int, default=5, help="timed runs (median)")
    ap.add_argument("--score-cols", default="", help="comma-separated: the kernels again with these score "
                    "programs' pool columns (kernels.tree_grow.score_split), beside the default")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shapes, args.budgets, args.pool, args.replays, args.reps = "smoke", "4,16", 40, 1, 1
    from common.random_head import head_model
    from common.record import environment, write_json
    from common.timing import log
    from dominospec.engine.domino_tree import TreeGrower
    from dominospec.engine.graphs import DraftGraphs

    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    out = dict(**environment(cuda), children=args.children, pool=args.pool, replays=args.replays, reps=args.reps,
               label="random head weights: costs only", shapes={})
    for shape in args.shapes.split(","):
        V, H, G, r, B = SHAPES[shape]
        K = B - 1
        g = torch.Generator(device).manual_seed(0)
        weights = [torch.randn(*s, generator=g, device=device) * scale for s, scale in
                   (((V, H), 1.0), ((3 * G, H), H ** -0.5), ((3 * G, G), G ** -0.5), ((r, H + G), (H + G) ** -0.5),
                    ((V, r), r ** -0.5))]
        model, embed = head_model(*[w.to(device, dtype) for w in weights], 1, B)
        z = torch.randn(K, H, generator=g, device=device).to(dtype)
        base = (torch.randn(K, V, generator=g, device=device) * 3).to(dtype)
        x_start = torch.tensor([7], device=device)
        rows = out["shapes"][shape] = dict(V=V, H=H, G=G, r=r, K=K, budgets={})
        for nodes in [int(n) for n in args.budgets.split(",")]:
            kinds = [("torch ops", "torch", None), ("kernels", "triton", None)] + \
                [(f"kernels, score cols {c}", "triton", int(c)) for c in args.score_cols.split(",") if c]
            growers = {name: TreeGrower(model, embed, nodes, args.children, args.pool, kernels=kernel == "triton",
                                        graphs=DraftGraphs(B, H, V, dtype, device, True) if cuda else None,
                                        score_cols=cols)
                       for name, kernel, cols in kinds}
            assert growers["kernels"].kernels is not None and growers["torch ops"].kernels is None
            trees = {name: grower.grow(z, base, x_start) for name, grower in growers.items()}  # captures
            same = len(set(paths(trees["kernels"])) & set(paths(trees["torch ops"])))
            times: dict = {name: [] for name in growers}
            for _ in range(args.reps):
                for name, grower in growers.items():  # interleaved
                    times[name].append(timed(lambda: grower.grow(z, base, x_start), args.replays, cuda))
            row = rows["budgets"][str(nodes)] = {name: statistics.median(t) for name, t in times.items()}
            row["nodes"], row["shared_nodes"] = trees["kernels"].size, same
            log(f"{shape} N={nodes}: " + ", ".join(f"{name} {row[name]:.3f} ms" for name in growers)
                + f", {same}/{row['nodes']} nodes shared")
            write_json(args.out, out)
            del growers, trees
    lines = [f"\n{out['device']}, torch {out['torch']}, triton {out.get('triton')}, {out['date']}; bf16, pool {args.pool}, "
             f"{args.children} children, one CUDA graph a build; random weights", "",
             "| shape | K | nodes | torch ops ms | kernels ms | × | nodes shared |", "|---|---|---|---|---|---|---|"]
    for shape, s in out["shapes"].items():
        for nodes, row in s["budgets"].items():
            lines.append(f"| {shape} | {s['K']} | {nodes} | {row['torch ops']:.3f} | {row['kernels']:.3f} | "
                         f"{row['torch ops'] / row['kernels']:.2f} | {row['shared_nodes']}/{row['nodes']} |")
    print("\n".join(lines))


def paths(tree) -> list:
    rows, out = [()], []
    for t, p in zip(tree.tokens.tolist(), tree.parents.tolist()):
        rows.append(rows[p] + (t,))
        out.append(rows[-1])
    return out


def timed(build, replays: int, cuda: bool) -> float:
    """ms a build: CUDA events around `replays` builds (wall time on CPU)."""
    import time

    if not cuda:
        t0 = time.perf_counter()
        for _ in range(replays):
            build()
        return (time.perf_counter() - t0) * 1e3 / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        build()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


if __name__ == "__main__":
    main()
