"""Where a speculative round's time goes on the GPU: the graphs' own device time against the host's work around them.

A SmolLM2-135M-shaped target and the H200 preset's draft architecture, both with random weights
(round *cost* does not depend on the weights; with a random draft τ ≈ 1, so every round drafts
and verifies K), on CUDA graphs as the engine runs them. For each dtype:

1. replay: the device time of one graph replay (CUDA events, median of --reps) of the target's
   forward at T = 1 .. K+1 rows, the draft block, and the rollout;
2. rounds: the engine's own rounds (`ar`, `dflash`, `domino` at fixed K): wall ms per round,
   and the device ms of its phases as the engine records them (engine.clock: CUDA events, so the
   host may queue the next phase while the GPU runs this one);
3. host: the host µs of the calls a round makes besides its graphs (event create / record, a
   synchronize, small copies each way, a kernel launch);
4. kernels (with --trace): torch.profiler over a few domino rounds: device-busy share of the wall
   and the kernels that take the most device time.

    python benchmarks/studies/round_profile_gpu.py [--params params/smollm2-h200.yaml] [--k 7] [--dtypes bfloat16,float32]
        [--prompts 4] [--new-tokens 96] [--context 300] [--reps 50] [--trace] --out result.json

Prints a markdown table last.
"""

from __future__ import annotations

from pathlib import Path

import sys
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import parser, random_draft, setup  # noqa: E402
from common.random_models import SMOLLM2_135M, random_target  # noqa: E402
from common.record import environment, require_cuda, write_json  # noqa: E402
from common.timing import median_ms  # noqa: E402


def smollm2_shaped(dtype: torch.dtype, device: torch.device):
    """A SmolLM2-135M-shaped Llama (sdpa attention) with random weights and a word-level tokenizer of its vocabulary."""
    from transformers import LlamaConfig

    config = LlamaConfig(**SMOLLM2_135M)
    config._attn_implementation = "sdpa"
    return random_target(config, dtype, device, name="smollm2-shaped-random")


def device_ms(fn, reps: int) -> float:
    """Median device ms of one call (CUDA events) after up to 10 warm-ups."""
    return median_ms(fn, reps, True, warmup=min(reps, 10), events=True)


def replay_times(engine, K: int, reps: int) -> dict:
    """The graphs the last generation built -> device ms of one replay each (T rows, draft block, rollout)."""
    kv, drafter = engine.runners.last
    out = {}
    for T, (graph, _) in sorted(kv.graphs.graphs.items()):
        out[f"target T={T}"] = device_ms(graph.replay, reps)
    if drafter is not None:
        for S, (graph, _) in sorted(drafter.graphs.graphs.items()):
            out[f"draft S={S}"] = device_ms(graph.replay, reps)
    holder = engine.path.graphs if engine.path is not None else None
    if holder is not None and "head rollout" in holder.sets:
        for key, (graph, _) in sorted(holder.sets["head rollout"].graphs.items()):
            out[f"rollout K={key[0]}"] = device_ms(graph.replay, reps)
    return out


def run_rounds(engine, prompts, new_tokens: int) -> dict:
    """Generate from every prompt -> wall ms per round and the phases' ms per round."""
    rounds = tokens = 0
    draft = rollout = verify = 0.0
    torch.cuda.synchronize()
    tick = time.perf_counter()
    for prompt in prompts:
        g = engine.generate(prompt, new_tokens)
        rounds += g.stats.rounds
        tokens += len(g.token_ids)
        draft, rollout, verify = draft + g.stats.draft_s, rollout + g.stats.rollout_s, verify + g.stats.verify_s
    torch.cuda.synchronize()
    wall = time.perf_counter() - tick
    return dict(rounds=rounds, tokens=tokens, wall_ms_per_round=1e3 * wall / rounds, tokens_per_s=tokens / wall,
                draft_ms=1e3 * draft / rounds, rollout_ms=1e3 * rollout / rounds, verify_ms=1e3 * verify / rounds)


def host_calls(n: int = 2000) -> dict:
    """Host µs of each call a round makes around its graphs, the GPU idle (mean of n calls)."""
    x = torch.zeros(4, device="cuda")
    pooled = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    calls = {
        "Event(enable_timing=True)": lambda i: torch.cuda.Event(enable_timing=True),
        "event.record() (pooled)": lambda i: pooled[i].record(),
        "torch.cuda.synchronize()": lambda i: torch.cuda.synchronize(),
        "torch.tensor([id], device=cuda)": lambda i: torch.tensor([i], device="cuda"),
        "small tensor .tolist()": lambda i: x.tolist(),
        "x.add_(1) (a kernel launch)": lambda i: x.add_(1),
    }
    out = {}
    for name, call in calls.items():
        torch.cuda.synchronize()
        tick = time.perf_counter()
        for i in range(n):
            call(i)
        out[name] = 1e6 * (time.perf_counter() - tick) / n
        torch.cuda.synchronize()
    return out


def trace(engine, prompt, new_tokens: int, top: int = 15) -> dict:
    """torch.profiler over one generation -> device-busy share of the wall and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tick = time.perf_counter()
        g = engine.generate(prompt, new_tokens)
        torch.cuda.synchronize()
        wall = time.perf_counter() - tick
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    busy = sum(e.device_time_total for e in kernels) / 1e3  # ms (kernels only; graph replays count their kernels)
    kernels.sort(key=lambda e: -e.device_time_total)
    return dict(rounds=g.stats.rounds, wall_ms=1e3 * wall, device_busy_ms=busy,
                top=[dict(name=e.key[:90], calls=e.count, ms=e.device_time_total / 1e3) for e in kernels[:top]])


def main() -> None:
    from common.cli import plain_engine
    from dominospec.engine import SpecEngine

    p = parser(__doc__, params="params/smollm2-h200.yaml", prompts=4, new_tokens=96)
    p.add_argument("--k", type=int, default=7)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--context", type=int, default=300, help="prompt tokens")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    require_cuda(hint="")
    device = torch.device("cuda")
    params = setup(args)  # its draft: and engine.candidate_pool
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SMOLLM2_135M["vocab_size"], (args.context + 7 * i,), generator=g).tolist()
               for i in range(args.prompts)]
    result = dict(**environment(True), k=args.k, context=args.context, new_tokens=args.new_tokens,
                  pool=params.engine.candidate_pool, dtypes={})
    result["host_us"] = host_calls()
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        target = smollm2_shaped(dtype, device)
        draft = random_draft(params, target).to(device)
        options = plain_engine(params.engine, draft_dtype="bfloat16", head_kernel="triton", cuda_graphs="on",
                               graph_capacity=1024, candidate_pool=params.engine.candidate_pool)
        engines = {"ar": SpecEngine(target, None, "ar", None, options),
                   f"dflash K={args.k}": SpecEngine(target, draft, "dflash", args.k, options),
                   f"domino K={args.k}": SpecEngine(target, draft, "domino", args.k, options)}
        entry = result["dtypes"][name] = dict(modes={})
        for mode, engine in engines.items():
            engine.generate(prompts[0], 16)  # captures
            engine.generate(prompts[0], 16)
            entry["modes"][mode] = rounds = run_rounds(engine, prompts, args.new_tokens)
            print(f"{name} {mode}: {rounds}", file=sys.stderr, flush=True)
        entry["replay_ms"] = replay_times(engines[f"domino K={args.k}"], args.k, args.reps)
        entry["replay_ms"].update({k: v for k, v in replay_times(engines["ar"], 0, args.reps).items() if k == "target T=1"})
        print(f"{name} replays: {entry['replay_ms']}", file=sys.stderr, flush=True)
        if args.trace:
            entry["trace"] = {m: trace(engines[m], prompts[0], 32) for m in ("ar", f"domino K={args.k}")}
        del engines, target, draft
        torch.cuda.empty_cache()
    write_json(args.out, result)
    print(f"\n{result['date']}, {result['device']}, torch {result['torch']}, random SmolLM2-135M-shaped target, "
          f"preset draft architecture, K = {args.k}, pool {result['pool']}, context {args.context}")
    print("\nhost µs a call (GPU idle): " + ", ".join(f"{k} {v:.1f}" for k, v in result["host_us"].items()))
    for name, entry in result["dtypes"].items():
        ar = entry["modes"]["ar"]
        print(f"\n**{name}**: replay device ms: " + ", ".join(f"{k} {v:.3f}" for k, v in entry["replay_ms"].items()))
        print("\n| mode | ms a round (wall) | draft / rollout / verify ms (device, engine.clock) | round ÷ AR step |")
        print("|---|---|---|---|")
        for mode, m in entry["modes"].items():
            print(f"| {mode} | {m['wall_ms_per_round']:.2f} | {m['draft_ms']:.2f} / {m['rollout_ms']:.2f} / "
                  f"{m['verify_ms']:.2f} | {m['wall_ms_per_round'] / ar['wall_ms_per_round']:.2f} |")
        for mode, tr in entry.get("trace", {}).items():
            print(f"\n{mode} trace: {tr['rounds']} rounds, wall {tr['wall_ms']:.1f} ms, device busy {tr['device_busy_ms']:.1f} ms")
            for k in tr["top"][:10]:
                print(f"  {k['ms']:8.2f} ms {k['calls']:6d}x {k['name']}")


if __name__ == "__main__":
    main()
