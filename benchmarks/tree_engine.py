"""Chain, first-token tree and DominoTree in the engine, at equal verify rows, greedy and sampled.

One run on this machine, every prompt through every mode back to back (interleaved): the Domino
chain (K drafts, K + 1 verify rows), the first-token tree (`engine.tree_width` W: the W best first
tokens, each drafted on: 1 + W·K rows) and DominoTree (`dominotree`, N nodes best first: 1 + N rows,
N = W·K by default, so both trees verify the same rows). Fixed shapes by default (no auto-K, no
prompt lookup), so τ does not depend on the machine's load; tokens/s are against AR in the same
run. `--num-draft auto` lets each mode choose its shape every round from one calibration of this
machine's costs (evaluate's rule): the chain its K, the first-token tree its width and K, DominoTree
how many of its best nodes to verify; the rows column then gives the most a round may verify.
Greedy modes are checked token for token against AR; at `--temperature` T > 0 the chain and
DominoTree run with the same seeds (their τ compared; losslessness is tests/engine/test_domino_tree.py's).

    python benchmarks/tree_engine.py --draft DIR [--params params.yaml] [--prompts 16] [--new-tokens 128] \
        [--width 4] [--nodes 28] [--children 4] [--temperature 0.7] [--out results.json]

Prints a markdown table per suite: mode, verify rows a round (the most), τ ± SE, exact match, × AR.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch


def main() -> None:
    from dominospec.config import load_params
    from dominospec.engine import Sampling, SpecEngine, load_draft
    from dominospec.engine.configure import engine_options, prepare_target
    from dominospec.files import sha256_file
    from dominospec.eval.prompts import load_suite
    from dominospec.eval.report import speedup_standard_error, tau_standard_error
    from dominospec.eval.stage import calibrate_together
    from dominospec.target import float32_matmul, load_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--draft", required=True, help="a trained draft with the Domino head (HF layout)")
    parser.add_argument("--prompts", type=int, default=16, help="per suite")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=4, help="the first-token tree's W")
    parser.add_argument("--nodes", type=int, default=None, help="DominoTree's N (default W·K: the same rows)")
    parser.add_argument("--children", type=int, default=4, help="DominoTree's children per expansion")
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled pass (0: none)")
    parser.add_argument("--num-draft", default=None, help="auto: auto-K / auto-budget (default: fixed K = B - 1, all N nodes)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the per-mode numbers here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    target = load_target(params.target)
    draft = load_draft(args.draft, target)
    linear = prepare_target(target, params.engine)
    base = dataclasses.replace(engine_options(params.engine, linear), ngram_assist=False, ngram_fork=False,
                               tree_width=1)
    K = int(draft.config.block_size) - 1
    nodes = args.nodes or args.width * K
    k = "auto" if args.num_draft == "auto" else K
    engines = {
        "ar": SpecEngine(target, None, "ar", None, base),
        "chain": SpecEngine(target, draft, "domino", k, base),
        f"first-token W={args.width}": SpecEngine(target, draft, "domino", k, dataclasses.replace(base, tree_width=args.width)),
        f"DominoTree N={nodes}": SpecEngine(target, draft, "dominotree", k, dataclasses.replace(
            base, tree_nodes=nodes, tree_children=args.children)),
    }
    rows = {"ar": 1, "chain": K + 1, f"first-token W={args.width}": 1 + args.width * K, f"DominoTree N={nodes}": 1 + nodes}
    passes = [("greedy", Sampling())]
    if args.temperature > 0:
        passes.append((f"T={args.temperature}", Sampling(temperature=args.temperature)))
    results = []
    print("| suite | sampling | mode | verify rows | τ ± SE | exact | × AR ± SE |\n|---|---|---|---|---|---|---|", flush=True)
    with float32_matmul("highest"), torch.inference_mode():
        for spec in params.evaluate.suites:
            suite = load_suite(spec, target.tokenizer, params.paths.prepared, args.prompts,
                               params.evaluate.max_prompt_tokens)
            if k == "auto" and engines["chain"].cost is None:  # one measurement of the machine for every mode
                calibrate_together(engines, "chain", suite.prompts[0])
            for name, engine in engines.items():  # warm-up: first calls allocate and pick kernels
                engine.generate(suite.prompts[0], 8)
            for label, sampling in passes:
                modes = engines if sampling.greedy else {m: e for m, e in engines.items() if "first-token" not in m}
                runs = {m: [] for m in modes}
                for i, prompt in enumerate(suite.prompts):
                    for m, engine in modes.items():
                        runs[m].append(engine.generate(prompt, args.new_tokens, sampling, seed=params.evaluate.seed + i))
                    print(f"[{suite.name} {label} {i + 1}/{len(suite.prompts)}]", flush=True)
                for m, gens in runs.items():
                    tau = sum(g.stats.round_tokens for g in gens) / sum(g.stats.rounds for g in gens)
                    tok_s = sum(g.stats.new_tokens for g in gens) / sum(g.stats.total_s for g in gens)
                    ar_s = sum(g.stats.new_tokens for g in runs["ar"]) / sum(g.stats.total_s for g in runs["ar"])
                    exact = (sum(g.token_ids == a.token_ids for g, a in zip(gens, runs["ar"])) / len(gens)
                             if sampling.greedy else None)
                    row = dict(suite=suite.name, sampling=label, mode=m, verify_rows=rows[m], tau=tau,
                               tau_se=tau_standard_error(gens), exact_match=exact, tokens_per_s=tok_s,
                               over_ar=tok_s / ar_s, over_ar_se=speedup_standard_error(gens, runs["ar"]),
                               prompts=len(gens))
                    results.append(row)
                    print(f"| {suite.name} | {label} | {m} | {rows[m]} | {tau:.3f} ± {row['tau_se'] or 0:.3f} | "
                          f"{'-' if exact is None else f'{exact:.2f}'} | {row['over_ar']:.2f} ± {row['over_ar_se'] or 0:.2f} |",
                          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            record = {**vars(args), "draft": Path(args.draft).name}  # the draft by name and weights, not by where it lay
            json.dump({"results": results, "args": record, "draft_sha256": sha256_file(Path(args.draft) / "model.safetensors"),
                       "date": time.strftime("%Y-%m-%d"),
                       "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    main()
