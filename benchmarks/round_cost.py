"""Where the time of a speculative round goes, against one autoregressive step: before and after the engine fixes.

One process; for each prompt every setup runs in turn (interleaved), so all see the same prompts
under the same machine load. A setup is (linear kernels, draft dtype, candidate pool, mode, K):

    before   linear torch  (MKL, weights re-packed per call), draft in the target dtype, full vocabulary
    after    linear packed (oneDNN, packed once),             draft bf16, pool M (engine params),
             grouped-query attention without repeated keys (runtime.attention)

Each side has its own AR baseline on its own target copy, so "round ÷ AR step" compares like with
like (the AR baseline gets every kernel the verify forward gets).

    python benchmarks/round_cost.py [--params params.yaml] [--draft DIR | --random-draft] [--k 7,3]
        [--suite sharegpt] [--prompts 4] [--new-tokens 64] [--threads 2] [--sides before,after]

--random-draft builds the default architecture (params `draft:`) with random weights: round *cost*
does not depend on draft quality (τ ≈ 1 then). Prints per setup: τ, tokens/s, speed-up over its AR,
ms per round of draft forward / chain / verify, the round in AR steps, the τ it needs for 1.0×
and 1.3×, and the speed-up that round cost gives at τ = 1.5, 2.0, 3.0 (τ × AR step ÷ round);
then the measured verify cost by rows (engine.cost) for each side.
"""

from __future__ import annotations

import datetime

import torch

from common.cli import load_draft, load_target, parser, setup, suites
from common.record import device_name
from common.timing import interleaved, warm_up

TAUS = (1.5, 2.0, 3.0)


def main() -> None:
    from common.cli import plain_engine
    from dominospec.engine import SpecEngine
    from dominospec.runtime.packed import pack_linears
    from dominospec.runtime.attention import use_grouped_sdpa
    from dominospec.eval.report import pooled

    p = parser(__doc__, threads=2, prompts=4, new_tokens=64)
    p.add_argument("--draft", help="draft dir (default: the export, else checkpoints/final)")
    p.add_argument("--random-draft", action="store_true", help="random weights, default architecture")
    p.add_argument("--k", default="7,3", help="drafts verified per round (ints or auto), comma-separated")
    p.add_argument("--sides", default="before,after")
    p.add_argument("--pool", type=int, help="candidate pool of the after side (default: engine.candidate_pool)")
    p.add_argument("--suite", default="sharegpt")
    p.add_argument("--ngram", action="store_true", help="also run the ngram mode on each side")
    args = p.parse_args()

    params = setup(args)
    sides = args.sides.split(",")
    pool = params.engine.candidate_pool if args.pool is None else args.pool
    engines, targets = {}, {}
    for side in sides:
        target = load_target(params)
        targets[side] = target
        draft = load_draft(params, target, args.draft, random=args.random_draft)
        if side == "after":
            pack_linears(target.model)
            use_grouped_sdpa(target.model)
            options = plain_engine(params.engine, draft_dtype="bfloat16", linear="packed", candidate_pool=pool)
        else:
            options = plain_engine(params.engine)
        engines[f"{side} ar"] = SpecEngine(target, None, "ar", None, options)
        if args.ngram:
            engines[f"{side} ngram K=7"] = SpecEngine(target, None, "ngram", 7, options)
        for k in args.k.split(","):
            num_draft = k if k == "auto" else int(k)
            engines[f"{side} domino K={k}"] = SpecEngine(target, draft, "domino", num_draft, options)
        engines[f"{side} dflash K={draft.config.block_size - 1}"] = SpecEngine(target, draft, "dflash", None, options)
    suite = next(suites(params, targets[sides[0]].tokenizer, args.prompts, [args.suite], 1024))
    warm_up(engines, suite.prompts[0])  # allocations, kernel choice, auto-K's cost measurement
    runs = interleaved(engines, suite.prompts, args.new_tokens)

    B = params.draft.block_size
    print(f"\n{datetime.date.today()}, {device_name(False)}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, target {params.target.dtype}, draft {'random' if args.random_draft else 'trained'}"
          f", suite {args.suite}: {len(suite.prompts)} prompts x <= {args.new_tokens} tokens, B = {B}, greedy, pool {pool}")
    taus = " / ".join(f"τ={t}" for t in TAUS)
    print(f"| setup | τ | tokens/s | speed-up | draft ms | chain ms | verify ms | round ÷ AR step | τ for 1.0× / 1.3× "
          f"| speed-up at {taus} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for side in sides:
        ar = pooled(runs[f"{side} ar"])
        ar_step = ar["verify_ms_per_round"]
        print(f"| {side} ar | 1 | {ar['tokens_per_s']:.1f} | 1.00 | | | {ar_step:.2f} | 1.00 | | |")
        for name in (n for n in engines if n.startswith(side) and not n.endswith(" ar")):
            p = pooled(runs[name])
            round_ms = p["draft_ms_per_round"] + p["rollout_ms_per_round"] + p["verify_ms_per_round"]
            cost = round_ms / ar_step
            at = " / ".join(f"{t / cost:.2f}" for t in TAUS)
            print(f"| {name} | {p['acceptance_length']:.2f} | {p['tokens_per_s']:.1f} | "
                  f"{p['tokens_per_s'] / ar['tokens_per_s']:.2f} | {p['draft_ms_per_round']:.2f} | "
                  f"{p['rollout_ms_per_round']:.2f} | {p['verify_ms_per_round']:.2f} | {cost:.2f} | "
                  f"{cost:.2f} / {1.3 * cost:.2f} | {at} |")
    print("\nmeasured phase costs (engine.cost, fastest of 5, ms): verify by rows r = 1..B, draft forward, chain step")
    for side in sides:
        engine = engines[f"{side} domino K={args.k.split(',')[0]}"]
        cost = engine.calibrate(suite.prompts[0])
        rows = " ".join(f"{v:.1f}" for v in cost.verify)
        print(f"{side}: verify [{rows}]  draft {cost.draft:.2f}  chain step {cost.rollout_step:.3f}  "
              f"round(K=7) ÷ step(1 row) {cost.round_ms(min(7, len(cost.verify) - 1)) / cost.verify[0]:.2f}")


if __name__ == "__main__":
    main()
