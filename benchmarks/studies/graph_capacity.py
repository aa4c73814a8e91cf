"""What a graph'd AR step costs by static-cache capacity, per target dtype (one GPU).

A forward on the engine's static caches (engine.target_kv.StaticTargetKV) attends over every row of
the cache, the rows past the current length masked out, so that its shape is fixed and it can
replay as a CUDA graph. What that costs depends on the capacity. This script times the engine's
own `ar` mode on static caches with CUDA graphs, pinned to one capacity at a time (one bucket:
`engine.spec.MIN_BUCKET` set to it), for each dtype: the AR step in ms (verify time ÷ rounds, the
fastest of the prompts, after a capture run).

    python benchmarks/studies/graph_capacity.py --gguf-dir DIR --prompts prompt_ids.jsonl \
        [--capacities 256,1024,2048,4096] [--dtypes float32,bfloat16] [--new-tokens 128]

--prompts: JSONL of {"prompt_ids": [...]} (the format of benchmarks/export_prompts.py); the first
--max-prompts are used. Prints one line per (dtype, capacity). Needs CUDA for the graphs (on CPU
the static runners run eagerly and the numbers say nothing about graphs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import dataclasses

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_target, parser, setup  # noqa: E402
from common.prompts import read_prompts  # noqa: E402
from dominospec.engine import SpecEngine
from dominospec.engine import spec as spec_module


def main() -> None:
    p = parser(__doc__, new_tokens=128)
    p.add_argument("--gguf-dir", required=True, help="folder holding the target's GGUF (target.gguf_file)")
    p.add_argument("--prompts", required=True, help="JSONL of {prompt_ids}")
    p.add_argument("--max-prompts", type=int, default=2)
    p.add_argument("--capacities", default="256,1024,2048,4096")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()

    params = setup(args)
    prompts = [ids for by_suite in read_prompts(args.prompts).values() for ids in by_suite][: args.max_prompts]
    for dtype in args.dtypes.split(","):
        target = load_target(params, args.gguf_dir, dtype)
        # a CUDA target: its linears stay torch's (packing is for CPU weights)
        for capacity in map(int, args.capacities.split(",")):
            spec_module.MIN_BUCKET = capacity  # one bucket: every generation runs on `capacity` rows
            options = dataclasses.replace(params.engine, linear="torch", cuda_graphs="on", graph_capacity=capacity)
            engine = SpecEngine(target, None, "ar", None, options)
            engine.generate(prompts[0], 16)  # captures the step's graph
            step_ms = []
            for ids in prompts:
                out = engine.generate(ids, args.new_tokens)
                step_ms.append(1000 * out.stats.verify_s / out.stats.rounds)
            print(f"{dtype} capacity {capacity}: AR step {min(step_ms):.2f} ms (static cache: {out.stats.static_cache}, "
                  f"graph failures: {len(engine.graph_failures())})", flush=True)
        del target


if __name__ == "__main__":
    main()
