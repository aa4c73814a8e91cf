"""Time the Domino head rollout at Qwen3-8B shapes on one GPU: eager torch, torch in a CUDA graph, Triton + graph, pool.

Measurement (i) of the kernel issue. Random weights at Qwen3-8B shapes (hidden 4096, GRU 1024,
rank 256, vocab 151,936), block 16 -> K = 15 drafts, pure_draft_prefix_len 1 -> 14 corrected
steps, bf16, batch 1. One row per path, median ms of one whole rollout (x_start, z, u -> d_1..d_15):

    torch (eager)            the model's rollout, the one torch reference (common.random_head.head_model)
    torch + graph            the same ops captured in one CUDA graph
    triton (eager)           kernels.head_rollout, launched from Python
    triton + graph           the same captured in one CUDA graph       target <= 0.45 ms
    triton, GEMV GRU + graph no [V, 3G] table: W_ih streamed per step (the ≈113 MB/step floor)
    pool torch / pool triton the top-2048 candidate pool; pool triton + graph: target <= 0.10 ms
                             (torch selects as engine.draft_head.candidate_pool: max over rows + unsorted
                             torch.topk; Triton with the fused kernels.pool_select: ids ascending)
    pool selection alone     torch max + topk (sorted, unsorted) against the fused selection, in a graph

`--shapes smollm2` times the embedded default's draft instead (vocab 49,152, hidden 576, GRU 256,
rank 64, block 8 -> K = 7): the head the end-to-end runs on SmolLM2-135M use.

Checks (a graph'd path can run and still be wrong; docs/design.md §6):
- every graph'd path's tokens equal its own eager run's, exactly (same kernels);
- the fused pool selection equals its reference exactly (kernels.pool_select.pool_select_reference),
  in fp32 and bf16, and in a graph; the set differs from torch.topk's only by ties at the boundary;
- Triton vs torch in fp32 (weights upcast, untimed): tokens equal, or the first difference at a
  near-tie (top-2 margin <= 1e-4 of the top logit);
- Triton vs torch in bf16: torch rounds every op to bf16, the kernels keep fp32 inside, so the
  chains may part; the first difference must be a near-tie (margin <= 2 bf16 ulps of the top logit).
  The pool path is compared with torch over the same pool (the fused selection's): in bf16 the
  2,048th value is usually tied, and torch.topk breaks the tie its own way.
The exit status is 1 if any check fails. Prints a markdown table last; --out writes JSON.

    python benchmarks/head_kernels_gpu.py --out head_kernels_h200.json [--reps 200] [--block-v N]
        [--shapes qwen3-8b|smollm2]
    python benchmarks/head_kernels_gpu.py --smoke --out /tmp/head_kernels_smoke.json   # CPU, tiny, TRITON_INTERPRET

Needs torch, triton, transformers and the dominospec package installed (`pip install --no-deps .`
is enough: it uses dominospec.kernels and benchmarks/common).
"""

from __future__ import annotations

import os

import torch

from common.cli import parser
from common.random_head import HEAD_SHAPES, head_model, head_rollouts, pool_ids, random_head
from common.record import environment, require_cuda, write_json
from common.timing import capture, median_ms

SHAPES = {name: s for name, s in HEAD_SHAPES.items() if name != "smoke"}
HBM_BYTES_PER_S = 4.8e12  # H200


def import_kernels():
    """dominospec.kernels.head_rollout (imported late: --smoke sets TRITON_INTERPRET before triton loads)."""
    import dominospec.kernels.head_rollout as head_rollout

    return head_rollout


def device_ms(fn, reps: int, cuda: bool) -> float:
    """Median ms of fn() after up to 10 warm-ups: CUDA events per call on the GPU, wall time on the CPU."""
    return median_ms(fn, reps, cuda, warmup=min(reps, 10), events=True)


def torch_chain(hr, w: dict, s: dict, ids: torch.Tensor):
    """The model's rollout over given pool ids -> (tokens [K], scored logits [K, V], -inf off the pool): the
    Triton pool path's reference."""
    model, table = head_model(w["embed"], w["w_ih"], w["w_hh"], w["w1"], w["w2"], s["prefix"], w["z"].shape[0])
    out = model.rollout(w["z"], w["base"], w["x_start"], table, pool=ids)
    return out.tokens, out.logits


def selection_checks(w: dict, s: dict, label: str) -> tuple[torch.Tensor, list[dict]]:
    """The fused pool selection on w's base logits -> (its ids, checks): equal to its reference exactly, and
    the same set as torch.topk's unless the M-th value is tied (then topk breaks the tie its own way)."""
    from dominospec.kernels.pool_select import pool_select, pool_select_reference

    base, P, M = w["base"], s["prefix"], s["pool"]
    ids = pool_select(base, P, M).clone()
    exact = torch.equal(ids, pool_select_reference(base, P, M))
    values = torch.sort(base[P:].max(dim=0).values.float(), descending=True).values
    tied = bool(values[M - 1] == values[M])
    same_set = set(ids.tolist()) == set(pool_ids(base, P, M).tolist())
    return ids, [dict(check=f"{label} fused pool selection vs its reference", equal=exact, first_divergence=None,
                      margin=None, ok=exact),
                 dict(check=f"{label} fused pool set vs torch.topk's (M-th value tied: {tied})", equal=same_set,
                      first_divergence=None, margin=None, ok=same_set or tied)]


def compare(ref_tokens, ref_scored, pool, tokens, rel_margin: float) -> dict:
    """Tokens vs a reference chain -> {equal, first_divergence, margin, ok}. ok: equal, or parted where the
    reference's scored logits put the other token within rel_margin · |top| of the top (a near-tie).
    ref_scored None (a kernel path as reference): only equality is ok."""
    want, got = ref_tokens.tolist(), tokens.tolist()
    if want == got:
        return dict(equal=True, first_divergence=None, margin=None, ok=True)
    j = next(i for i in range(len(want)) if want[i] != got[i])
    if ref_scored is None:
        return dict(equal=False, first_divergence=j, margin=None, ok=False)
    scored = ref_scored[j].float()  # [V], or [M] over the pool for a corrected step
    column = got[j]
    if pool is not None and scored.numel() == pool.numel():
        hits = (pool == got[j]).nonzero()
        if hits.numel() == 0:  # outside the pool: not a tie of anything the reference scored
            return dict(equal=False, first_divergence=j, margin=None, ok=False)
        column = int(hits[0, 0])
    top = float(scored.max())
    margin = top - float(scored[column])
    return dict(equal=False, first_divergence=j, margin=margin, ok=margin <= rel_margin * max(abs(top), 1.0))


def run(args) -> dict:
    hr = import_kernels()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    s = HEAD_SHAPES["smoke"] if args.smoke else SHAPES[args.shapes]
    budget = int(args.table_budget_gb * 2 ** 30)
    rows, checks = [], []

    # fp32 correctness, untimed: Triton (eager, and graph'd on the GPU) vs eager torch (the pool: the same ids)
    w32 = random_head(s, torch.float32, device)
    paths = head_rollouts(w32, s, args.block_v, budget)
    ids32, pool_checks = selection_checks(w32, s, "fp32")
    checks += pool_checks
    ref_full, ref_pool = paths["torch"](), torch_chain(hr, w32, s, ids32)
    for name, ref, pool in (("triton", ref_full, None), ("pool triton", ref_pool, ids32)):
        if cuda:  # a captured graph has not run yet: replay it, then read its static outputs
            replay, out = capture(paths[name])
            replay()
            torch.cuda.synchronize()
        tokens = (out if cuda else paths[name]())[0]
        same_pool = " (same pool)" if pool is not None else ""
        checks.append(dict(check=f"fp32 {name}{' + graph' if cuda else ''} vs eager torch{same_pool}",
                           **compare(ref[0], ref[1], pool, tokens, 1e-4)))
    del w32, paths

    # bf16 timing: each path eager and (on the GPU) graph'd
    w = random_head(s, torch.bfloat16, device)
    paths = head_rollouts(w, s, args.block_v, budget)
    ids16, pool_checks = selection_checks(w, s, "bf16")
    checks += pool_checks
    eager = {name: fn() for name, fn in paths.items()}
    for name, fn in paths.items():
        rows.append(dict(path=f"{name} (eager)", ms=device_ms(fn, args.reps, cuda)))
        if not cuda:
            continue
        replay, out = capture(fn)
        replay()
        torch.cuda.synchronize()
        checks.append(dict(check=f"bf16 {name} + graph vs its eager run",
                           **compare(eager[name][0], None, None, out[0], 0.0)))
        rows.append(dict(path=f"{name} + graph", ms=device_ms(replay, args.reps, cuda)))
    # the pool's selection alone, as the pool paths run it: torch (max over rows, topk) and the fused kernels
    from dominospec.kernels.pool_select import pool_select, pool_workspace

    P, M = s["prefix"], s["pool"]
    pool_ws = pool_workspace(s["vocab"], M, w["base"].dtype, device)
    selections = {
        "pool selection alone (max + topk)": lambda: (torch.topk(w["base"][P:].max(dim=0).values, M).indices, None),
        "pool selection, topk unsorted": lambda: (pool_ids(w["base"], P, M), None),
        "pool selection, the max over rows alone": lambda: (w["base"][P:].max(dim=0).values, None),
        "pool selection, fused (kernels.pool_select)": lambda: (pool_select(w["base"], P, M, pool_ws), None),
    }
    for name, fn in selections.items():
        if not cuda:  # the smoke run: eager, on the interpreter
            rows.append(dict(path=f"{name} (eager)", ms=device_ms(fn, args.reps, cuda)))
            continue
        replay, out = capture(fn)
        replay()
        torch.cuda.synchronize()
        if "fused" in name:
            same = torch.equal(out[0], ids16)
            checks.append(dict(check="bf16 fused pool selection + graph vs its eager run", equal=same,
                               first_divergence=None, margin=None, ok=same))
        rows.append(dict(path=f"{name} + graph", ms=device_ms(replay, args.reps, cuda)))
    sweep = plan_sweep(hr, w, s, budget, args) if args.sweep and cuda else []
    profile = kernel_profile(hr, w, s, budget) if args.profile and cuda else []
    bf16_ulps = 2 * 2 ** -7  # 2 ulps of bf16 (8 significant bits), relative to the top logit
    checks.append(dict(check="bf16 triton vs eager torch",
                       **compare(*eager["torch"], None, eager["triton"][0], bf16_ulps)))
    checks.append(dict(check="bf16 pool triton vs eager torch (same pool)",
                       **compare(*torch_chain(hr, w, s, ids16), ids16, eager["pool triton"][0], bf16_ulps)))

    V, H, G, r, P, K = s["vocab"], s["hidden"], s["gru"], s["rank"], s["prefix"], s["num_draft"]
    # bf16 bytes read per corrected step: W2, the base row, W_hh, W1 (GEMV: all of W_ih; table: one row, W1_s)
    per_step_gemv = 2 * (V * r + V + 3 * G * G + 3 * G * H + (H + G) * r)
    per_step_table = 2 * (V * r + V + 3 * G * G + 3 * G + G * r)
    return dict(
        **environment(cuda), smoke=args.smoke, shapes=dict(s, corrected_steps=K - P, dtype="bfloat16", batch=1), block_v=args.block_v,
        gru_table=V * 3 * G * 2 <= budget, reps=args.reps,
        memory_floor_ms=dict(gemv_gru=per_step_gemv * (K - P) / HBM_BYTES_PER_S * 1e3,
                             table_gru=per_step_table * (K - P) / HBM_BYTES_PER_S * 1e3,
                             mb_per_step_gemv=per_step_gemv / 1e6, mb_per_step_table=per_step_table / 1e6),
        targets_ms={"triton + graph": 0.45, "pool triton + graph": 0.10},
        rows=rows, checks=checks, ok=all(c["ok"] for c in checks), sweep=sweep,
        profile=profile,
    )


SWEEP = {  # launch shapes tried by --sweep (kernels.head_rollout.rollout_plan's arguments)
    "full": dict(block_v=[32], score_programs=[1056], block_g=[64, 128], gru_warps=[2, 4, 8]),
    "pool": dict(block_v=[16], score_programs=[0], block_g=[64, 128], gru_warps=[2, 4, 8]),
}


PROFILED = [  # (vocab, rollout_plan arguments) whose kernels --profile times one by one
    ("full", {}), ("pool", {}),
]


def kernel_profile(hr, w: dict, s: dict, budget: int, runs: int = 10) -> list[dict]:
    """torch.profiler over eager Triton rollouts: device µs per launch of each kernel, for each plan in PROFILED
    (kernel times do not depend on how they are launched; a graph only removes the gaps between them)."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for vocab, plan in PROFILED:
        plan = dict(plan)
        fn = head_rollouts(w, s, plan.pop("block_v", None), budget, plan)["triton" if vocab == "full" else "pool triton"]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                fn()
            torch.cuda.synchronize()
        kernels = {}
        for event in prof.key_averages():
            total = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
            if total > 0 and event.count:
                kernels[event.key[:60]] = dict(us_per_launch=round(total / event.count, 2),
                                               launches_per_rollout=event.count / runs,
                                               us_per_rollout=round(total / runs, 1))
        out.append(dict(vocab=vocab, plan=plan, kernels=kernels))
        print(f"profile {vocab} {plan}: " + "; ".join(f"{k} {v['us_per_launch']} µs x {v['launches_per_rollout']:g}"
                                                      for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_rollout"])),
              flush=True)
    return out


def plan_sweep(hr, w: dict, s: dict, budget: int, args) -> list[dict]:
    """Every launch shape in SWEEP, Triton + graph, bf16 -> rows {vocab, plan, ms, same tokens as the default}.
    score_programs 0 = one program per tile."""
    import itertools

    out = []
    default = {name: head_rollouts(w, s, None, budget)[name]()[0] for name in ("triton", "pool triton")}
    for vocab, grid in SWEEP.items():
        name = "triton" if vocab == "full" else "pool triton"
        for values in itertools.product(*grid.values()):
            plan = dict(zip(grid, values))
            plan["score_programs"] = plan["score_programs"] or 1 << 30
            fn = head_rollouts(w, s, plan.pop("block_v"), budget, plan)[name]
            replay, res = capture(fn)
            replay()
            torch.cuda.synchronize()
            same = res[0].tolist() == default[name].tolist()
            out.append(dict(vocab=vocab, block_v=values[0], **plan, ms=device_ms(replay, max(50, args.reps // 4), True),
                            same_tokens=same))
        best = sorted((r for r in out if r["vocab"] == vocab), key=lambda r: r["ms"])[:5]
        print(f"sweep {vocab}: best 5: " + "; ".join(f"{r['ms']:.3f} ms {r}" for r in best), flush=True)
    return out


def table(result: dict) -> str:
    targets = result["targets_ms"]
    lines = ["| path | head rollout (ms) | target |", "|---|---|---|"]
    lines += [f"| {r['path']} | {r['ms']:.3f} | {('≤ %.2f' % targets[r['path']]) if r['path'] in targets else ''} |"
              for r in result["rows"]]
    floor = result["memory_floor_ms"]
    lines.append(f"| memory floor, GEMV GRU ({floor['mb_per_step_gemv']:.1f} MB/step at 4.8 TB/s) | "
                 f"{floor['gemv_gru']:.3f} | |")
    lines.append(f"| memory floor, table GRU ({floor['mb_per_step_table']:.1f} MB/step) | {floor['table_gru']:.3f} | |")
    lines += ["", "| check | equal | first divergence | margin | ok |", "|---|---|---|---|---|"]
    lines += [f"| {c['check']} | {c['equal']} | {c['first_divergence']} | {c['margin']} | {c['ok']} |"
              for c in result["checks"]]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, params=None)
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--block-v", type=int, default=None, help="W2 kernel columns per program (default: scoring_blocks)")
    p.add_argument("--table-budget-gb", type=float, default=2.0, help="GRU [V, 3G] table when it fits")
    p.add_argument("--sweep", action="store_true", help="also time every launch shape in SWEEP (GPU)")
    p.add_argument("--profile", action="store_true", help="also time each kernel of the plans in PROFILED (GPU)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter, no graphs")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-8b", help="the head's shapes (not --smoke)")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        args.reps = min(args.reps, 3)
    else:
        require_cuda()
    result = run(args)
    write_json(args.out, result)
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}, {result['date']}; "
          f"shapes {result['shapes']}; JSON: {args.out}\n")
    print(table(result))
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
