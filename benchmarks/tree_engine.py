"""The Domino chain and DominoTree in the engine, greedy and sampled.

One run on this machine, every prompt through every mode back to back (interleaved): the Domino
chain (K drafts, K + 1 verify rows) and DominoTree (`domino` with engine.tree.shape best_first, N
nodes best first: 1 + N rows, params' engine.tree.nodes by default). Fixed shapes by default (no
auto-K, no prompt lookup), so τ does not depend on the machine's load; tokens/s are against AR in
the same run. `--num-draft auto` lets each mode choose its shape every round from one calibration of
this machine's costs (evaluate's rule): the chain its K, DominoTree how many of its best nodes to
verify; the rows column then gives the most a round may verify.
Greedy modes are checked token for token against AR; at `--temperature` T > 0 the chain and
DominoTree run with the same seeds (their τ compared; losslessness is tests/engine/test_domino_tree.py's).

    python benchmarks/tree_engine.py --draft DIR [--params params.yaml] [--prompts 16] [--new-tokens 128] \
        [--nodes 28] [--children 4] [--temperature 0.7] [--out results.json]

Prints a markdown table per suite: mode, verify rows a round (the most), τ ± SE, exact match, × AR.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from common.cli import load_draft, load_target, parser, setup, suites
from common.record import environment, write_json
from common.timing import interleaved, warm_up


def main() -> None:
    from dominospec.engine import Sampling, SpecEngine
    from dominospec.runtime.prepare import prepare_target
    from dominospec.eval.report import speedup_standard_error, tau_standard_error
    from dominospec.eval.stage import calibrate_together
    from dominospec.target import float32_matmul

    p = parser(__doc__, threads=2, prompts=16, new_tokens=128)
    p.add_argument("--draft", required=True, help="a trained draft with the Domino head (HF layout)")
    p.add_argument("--nodes", type=int, default=None, help="DominoTree's N (default: params' engine.tree.nodes)")
    p.add_argument("--children", type=int, default=4, help="DominoTree's children per expansion")
    p.add_argument("--temperature", type=float, default=0.7, help="the sampled pass (0: none)")
    p.add_argument("--num-draft", default=None, help="auto: auto-K / auto-budget (default: fixed K = B - 1, all N nodes)")
    p.add_argument("--out", default=None, help="write the per-mode numbers here (JSON)")
    args = p.parse_args()
    params = setup(args)
    target = load_target(params)
    draft = load_draft(params, target, args.draft)
    linear = prepare_target(target, params.engine)
    base = dataclasses.replace(params.engine, linear=linear, ngram_assist=False, ngram_fork=False).with_tree(
        shape="chain")
    K = int(draft.config.block_size) - 1
    nodes = args.nodes or params.engine.tree.nodes
    k = "auto" if args.num_draft == "auto" else K
    engines = {
        "ar": SpecEngine(target, None, "ar", None, base),
        "chain": SpecEngine(target, draft, "domino", k, base),
        f"DominoTree N={nodes}": SpecEngine(target, draft, "dominotree", k, base.with_tree(
            nodes=nodes, children=args.children)),
    }
    rows = {"ar": 1, "chain": K + 1, f"DominoTree N={nodes}": 1 + nodes}
    passes = [("greedy", Sampling())]
    if args.temperature > 0:
        passes.append((f"T={args.temperature}", Sampling(temperature=args.temperature)))
    results = []
    print("| suite | sampling | mode | verify rows | τ ± SE | exact | × AR ± SE |\n|---|---|---|---|---|---|---|", flush=True)
    with float32_matmul("highest"), torch.inference_mode():
        for suite in suites(params, target.tokenizer, args.prompts):
            if k == "auto" and engines["chain"].cost is None:  # one measurement of the machine for every mode
                calibrate_together(engines, "chain", suite.prompts[0])
            warm_up(engines, suite.prompts[0])  # first calls allocate and pick kernels
            for label, sampling in passes:
                runs = interleaved(engines, suite.prompts, args.new_tokens, sampling, params.evaluate.seed,
                                   f"{suite.name} {label}")
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
    if args.out:  # the draft by name and weights, not by where it lay
        record = {**vars(args), "draft": Path(args.draft).name}
        write_json(args.out, {"results": results, "args": record, **environment(False, draft=args.draft)})


if __name__ == "__main__":
    main()
