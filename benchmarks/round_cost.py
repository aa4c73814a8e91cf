"""Where the time of a speculative round goes, against one autoregressive step, for several K.

One process, one target, one draft; for each prompt every engine runs in turn (AR, head off at
K = B-1, Domino at each K), so all modes see the same prompts under the same machine load.

    python benchmarks/round_cost.py --params params.yaml [--draft DIR] [--k 7,3,2] \
        [--suite sharegpt] [--prompts 8] [--new-tokens 128] [--device cpu|cuda] [--dtype float32]

Per mode: pooled τ (round tokens ÷ verify rounds), tokens/s, speedup over AR, mean ms per round
of the draft forward (+ context append), the rollout and the verify forward (+ acceptance, KV
crop), the round's cost in AR steps, and the τ a round of that cost needs for 1.0× and 1.3×.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys

import torch


def main() -> None:
    from dominospec.config import load_params
    from dominospec.engine import SpecEngine, draft_dir, load_draft
    from dominospec.eval.prompts import load_suite
    from dominospec.eval.report import pooled
    from dominospec.target import load_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--draft", help="draft dir (default: the export, else checkpoints/final)")
    parser.add_argument("--k", default="7,3,2", help="drafts verified per round, comma-separated")
    parser.add_argument("--suite", default="sharegpt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", help="override target.device")
    parser.add_argument("--dtype", help="override target.dtype")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    params = load_params(args.params)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_params = dataclasses.replace(params.target, **{k: v for k, v in
                                                           (("device", args.device), ("dtype", args.dtype)) if v})
    target = load_target(target_params)
    draft = load_draft(args.draft or draft_dir(params.paths), target)
    B = draft.config.block_size
    engines = {"ar": SpecEngine(target, None, "ar"), f"dflash K={B - 1}": SpecEngine(target, draft, "dflash")}
    for k in (int(x) for x in args.k.split(",")):
        engines[f"domino K={k}"] = SpecEngine(target, draft, "domino", k)
    suite = load_suite(args.suite, target.tokenizer, params.paths.prepared, args.prompts, 1024)
    for engine in engines.values():  # warm-up: first-call allocations and kernel selection
        engine.generate(suite.prompts[0], 8)
    runs = {name: [] for name in engines}
    for i, prompt in enumerate(suite.prompts):
        for name, engine in engines.items():
            runs[name].append(engine.generate(prompt, args.new_tokens))
        print(f"prompt {i + 1}/{len(suite.prompts)} done", file=sys.stderr, flush=True)

    ar = pooled(runs["ar"])
    ar_step = ar["verify_ms_per_round"]
    device = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else platform.processor() or "cpu"
    print(f"\n{device}, torch {torch.__version__}, threads {torch.get_num_threads()}, {target_params.dtype}, "
          f"suite {args.suite}: {len(suite.prompts)} prompts x <= {args.new_tokens} tokens, B = {B}, greedy")
    print("| mode | τ | tokens/s | speedup | draft ms | rollout ms | verify ms | round ÷ AR step | τ for 1.0× / 1.3× |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| ar | 1 | {ar['tokens_per_s']:.1f} | 1.00 | | | {ar_step:.2f} | 1.00 | |")
    for name in list(engines)[1:]:
        p = pooled(runs[name])
        round_ms = p["draft_ms_per_round"] + p["rollout_ms_per_round"] + p["verify_ms_per_round"]
        cost = round_ms / ar_step
        print(f"| {name} | {p['acceptance_length']:.2f} | {p['tokens_per_s']:.1f} | "
              f"{p['tokens_per_s'] / ar['tokens_per_s']:.2f} | {p['draft_ms_per_round']:.2f} | "
              f"{p['rollout_ms_per_round']:.2f} | {p['verify_ms_per_round']:.2f} | {cost:.2f} | "
              f"{cost:.2f} / {1.3 * cost:.2f} |")


if __name__ == "__main__":
    main()
