"""The free anchor: transformers' own prompt-lookup decoding against our engine, in one run.

For the first N prompts of each suite, greedy, 2 threads, every setup runs prompt by prompt in turn:

    hf generate        `model.generate(ids, max_new_tokens)` on a stock copy of the target (nn.Linear as loaded)
    hf prompt lookup   `model.generate(ids, max_new_tokens, prompt_lookup_num_tokens=7)`, same stock copy
    ar / ngram / domino  our engine on its own copy prepared by params `engine:` (packed linears, bf16 draft,
                       pool, `evaluate.num_draft`); domino only with --draft DIR or --random-draft
    domino no fork     with --fork-too: domino with `engine.ngram_fork` off (a lookup hit replaces the
                       chain), interleaved with the forking domino of params
    domino chain       with --tree-too: domino with `engine.tree.shape: chain` (the draft's best first token only),
                       interleaved with the domino of params (its draft tree)
    ... plain          with --plain-too: the same three on the stock copy (`engine.linear: torch`), so one
                       run says which linear kernels serve each mode best on this machine

Reports per suite and setup: tokens/s (new tokens ÷ wall time, prefill included), speed-up over hf
generate and over our ar, τ (our modes), exact match with hf generate and with our ar, and for our
modes every divergence from our ar with the target's top-2 logit gap there (eval.report).

    python benchmarks/anchor.py [--params params.yaml] [--prompts 8] [--new-tokens 128] [--dtype bfloat16]
        [--draft DIR | --random-draft] [--suites sharegpt,humaneval] [--fork-too] [--tree-too] [--json out.json]

--dtype bfloat16 is the bf16 target mode: every setup runs the bf16 target, exact match is then
against bf16 AR, and the divergences' top-2 gaps show whether they happen only at near-ties.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from common.cli import load_draft, load_target, parser, setup, suites
from common.record import environment, write_json
from common.timing import warm_up


def main() -> None:
    from dominospec.engine import SpecEngine
    from dominospec.runtime.prepare import prepare_target
    from dominospec.eval.report import first_divergence, top2_margin

    p = parser(__doc__, threads=2, prompts=8, new_tokens=128)
    p.add_argument("--dtype", help="override target.dtype (bfloat16: the bf16 target mode)")
    p.add_argument("--draft", help="a trained draft dir for the domino setup")
    p.add_argument("--random-draft", action="store_true")
    p.add_argument("--suites", default="sharegpt,humaneval")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--fork-too", action="store_true",
                   help="also run domino with engine.ngram_fork off, interleaved (needs --draft or --random-draft)")
    p.add_argument("--tree-too", action="store_true",
                   help="also run domino with engine.tree.shape chain, interleaved (needs --draft or --random-draft)")
    p.add_argument("--plain-too", action="store_true",
                   help="also run our ar / ngram / domino on the target as loaded (engine.linear: torch), interleaved")
    args = p.parse_args()

    params = setup(args)
    stock = load_target(params, dtype=args.dtype)  # transformers as users run it
    ours = load_target(params, dtype=args.dtype)
    target_dtype = stock.identity.dtype
    options = dataclasses.replace(params.engine, linear=prepare_target(ours, params.engine))
    engines = {"ar": SpecEngine(ours, None, "ar", None, options),
               "ngram": SpecEngine(ours, None, "ngram", "auto" if params.evaluate.num_draft == "auto" else None, options)}
    if args.draft or args.random_draft:
        draft = load_draft(params, ours, args.draft, random=args.random_draft)
        engines["domino"] = SpecEngine(ours, draft, "domino", params.evaluate.num_draft, options)
        if args.tree_too:
            engines["domino chain"] = SpecEngine(ours, draft, "domino", params.evaluate.num_draft,
                                                 options.with_tree(shape="chain"))
        if args.fork_too:
            engines["domino no fork"] = SpecEngine(ours, draft, "domino", params.evaluate.num_draft,
                                                   dataclasses.replace(options, ngram_fork=False))
    if args.plain_too:  # the same modes on the stock target (nn.Linear as loaded), the draft path unpacked too
        plain = dataclasses.replace(options, linear="torch")
        engines["ar plain"] = SpecEngine(stock, None, "ar", None, plain)
        engines["ngram plain"] = SpecEngine(stock, None, "ngram", "auto" if params.evaluate.num_draft == "auto" else None, plain)
        if "domino" in engines:
            engines["domino plain"] = SpecEngine(stock, load_draft(params, stock, args.draft) if args.draft else draft, "domino",
                                                 params.evaluate.num_draft, plain)
    stops = list(engines["ar"].stop_ids)

    def hf(ids: list[int], lookup: bool) -> tuple[list[int], float]:
        x = torch.tensor([ids])
        extra = {"prompt_lookup_num_tokens": 7} if lookup else {}
        t0 = time.perf_counter()
        out = stock.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                   do_sample=False, eos_token_id=stops, pad_token_id=stops[0], **extra)
        seconds = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), seconds

    results = {}
    for spec, suite in zip(args.suites.split(","), suites(params, ours.tokenizer, args.prompts, args.suites.split(","), 1024)):
        with torch.inference_mode():
            hf(suite.prompts[0], False), hf(suite.prompts[0], True)
        warm_up(engines, suite.prompts[0])  # and auto-K's cost measurement
        hf_runs, runs = {"hf generate": [], "hf prompt lookup": []}, []
        for i, ids in enumerate(suite.prompts):
            with torch.inference_mode():
                hf_runs["hf generate"].append(hf(ids, False))
                hf_runs["hf prompt lookup"].append(hf(ids, True))
            runs.append({mode: engine.generate(ids, args.new_tokens) for mode, engine in engines.items()})
            print(f"[{spec} {i + 1}/{len(suite.prompts)}]", file=sys.stderr, flush=True)
        reference = [tokens for tokens, _ in hf_runs["hf generate"]]
        base = sum(len(t) for t, _ in hf_runs["hf generate"]) / sum(s for _, s in hf_runs["hf generate"])
        rows = {}
        for name, pairs in hf_runs.items():
            tps = sum(len(t) for t, _ in pairs) / sum(s for _, s in pairs)
            rows[name] = {"tokens_per_s": tps, "speedup_vs_hf": tps / base,
                          "exact_vs_hf": sum(t == r for (t, _), r in zip(pairs, reference)) / len(pairs)}
        ar_tps = None
        for mode in engines:
            gens = [r[mode] for r in runs]
            tps = sum(g.stats.new_tokens for g in gens) / sum(g.stats.total_s for g in gens)
            ar_tps = tps if mode in ("ar", "ar plain") else ar_tps  # each set against its own AR
            rounds = sum(g.stats.rounds for g in gens)
            rows[mode] = {"tokens_per_s": tps, "speedup_vs_hf": tps / base, "speedup_vs_ar": tps / ar_tps,
                          "tau": sum(g.stats.round_tokens for g in gens) / rounds,
                          "exact_vs_hf": sum(g.token_ids == r for g, r in zip(gens, reference)) / len(gens),
                          "exact_vs_ar": sum(g.token_ids == r["ar"].token_ids for g, r in zip(gens, runs)) / len(gens)}
        rows["divergences_from_ar"] = []
        for i, (ids, run) in enumerate(zip(suite.prompts, runs)):
            ref = run["ar"].token_ids
            for mode in (m for m in run if m != "ar"):
                at = first_divergence(ref, run[mode].token_ids)
                if at is not None:
                    rows["divergences_from_ar"].append({"prompt": i, "mode": mode, "position": at,
                                                        "top2_margin": top2_margin(engines["ar"], ids + ref[:at])})
        results[spec] = rows

    env = environment(False, draft=args.draft)
    print(f"\n{env['date']}, {env['device']}, torch {env['torch']}, "
          f"threads {env['threads']}, target {target_dtype}, greedy, {args.prompts} prompts x "
          f"<= {args.new_tokens} tokens, engine {dataclasses.asdict(params.engine)}, num_draft {params.evaluate.num_draft}")
    print("| suite | setup | tokens/s | vs hf generate | vs our ar | τ | exact vs hf | exact vs our ar |")
    print("|---|---|---|---|---|---|---|---|")
    for spec, rows in results.items():
        for name, r in rows.items():
            if name == "divergences_from_ar":
                continue
            print(f"| {spec} | {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_hf']:.2f} | "
                  f"{r.get('speedup_vs_ar', float('nan')):.2f} | {r.get('tau', float('nan')):.2f} | "
                  f"{r['exact_vs_hf']:.2f} | {r.get('exact_vs_ar', float('nan')):.2f} |")
        for d in rows["divergences_from_ar"]:
            print(f"  divergence {spec} prompt {d['prompt']} {d['mode']} at {d['position']}: top-2 gap {d['top2_margin']:.4f}")
    if args.json:
        write_json(args.json, {"environment": env, **results})


if __name__ == "__main__":
    main()
