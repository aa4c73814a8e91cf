"""The engine on one GPU: (ii) end to end on SmolLM2-135M, and (iv) a projection for Qwen3-8B.

Measurements (ii) and (iv) of the kernel issue (docs/kernels.md). One process, one command:

    python benchmarks/gpu_engine.py --gguf-dir DIR --draft DRAFT_DIR --suite-from-study data.pt \
        --out gpu_engine_h200.json [--max-prompts 16] [--new-tokens 256] [--budget-seconds 540] \
        [--head-json head_kernels_h200.json] [--skip-e2e] [--skip-projection]
    python benchmarks/gpu_engine.py --smoke --out /tmp/gpu_engine_smoke.json   # CPU, tiny random models

(ii) End to end: the target (`DIR/SmolLM2-135M-Instruct.Q4_1.gguf`, bf16 on CUDA by default) and a
trained draft; greedy, batch 1, `--new-tokens` per prompt. Prompts come from the packed file of
benchmarks/draft_study.py (`suites`: sharegpt, humaneval) or from `--prompts` (.pt list, or JSONL of
{"prompt_ids": [...], "suite": optional}). The suites alternate prompt by prompt, and for each prompt
every mode runs in turn (interleaved, so all see the same machine drift):
    ar            SpecEngine "ar": HF eager, one forward per token (the reference of exactness)
    graph ar      HF `generate`, cache_implementation="static"; on CUDA `generate` compiles the decode
                  step with torch.compile(mode="reduce-overhead") = CUDA graphs (transformers' own
                  recipe). Warmed up first; checked token for token against `ar`
    ngram         SpecEngine "ngram" (prompt lookup, K = ngram_num_draft)
    dflash        SpecEngine "dflash" (head off, K = B - 1)
    dflash+fork   head off with the lookup and the fork of domino+fork and dominotree+fork: the head
                  judged against head off on equal options
    domino        SpecEngine "domino" with engine.tree.shape chain, head_kernel triton on CUDA (torch on CPU)
    domino+ngram  the same with ngram_assist
    domino+fork   the same with ngram_assist and ngram_fork (a lookup hit verified beside the chain,
                  two branches of one forward, engine.proposers)
    dominotree+fork  SpecEngine "dominotree" (`--tree-nodes` N best-first nodes, `--tree-children` a node,
                  engine.domino_tree) with ngram_assist and ngram_fork: `domino`'s default (params.yaml's
                  engine.tree.shape best_first); under auto-K it verifies the best n <= N nodes a round
    ... graphs    the same engine modes on static caches with CUDA graphs (`engine.cuda_graphs`: the
                  verify / AR step and the draft block replay captured graphs), transformers' forward;
                  "ar graphs" is its CUDA-graph AR. Each is checked token for token against eager `ar`,
                  and the speculative ones against "ar graphs" (lossless within the graph'd path)
    ... lean      the same on the lean decoder (`engine.lean_target`: fused Triton kernels, its own KV
                  caches, CUDA graphs); "ar lean" is our AR, the baseline of "× our graph AR" when it runs
`--tree-nodes 64,128,256` runs DominoTree + fork at each budget, as modes "dominotree64+fork", ...
`--temperature 0.7` adds a sampled pass of `--sampled-modes` on the same prompts (seeded per prompt,
speed-ups over the first, our lean AR sampled); `--fp32-prompts 3` adds an fp32 pass of `--fp32-modes`
on that many prompts a suite, each checked token for token against our lean AR in fp32 (result
"e2e_fp32"); `--no-graph-ar` leaves transformers' compiled `generate` out.
Every engine runs each shape once before timing (`SpecEngine.capture`), so no capture falls inside
a timed prompt; before each prompt every engine also generates 2 tokens of it untimed (a new prompt
length's first calls: kernel picks, compiles), and the modes' order rotates from prompt to prompt, so
no mode pays those first calls or always runs first. `--reference` names the mode the others are checked against (default `ar`, eager:
minutes a prompt in bf16, where no speculative mode is exact anyway; `ar lean` spares them).
Per mode the table gives the device ms of the round's phases and the host ms of its plan / launch /
wait (the acceptance's read) / commit (`GenerationStats.host_s`).
τ is pooled (docs/design.md §6) with its SE over prompts; tokens/s = Σ new tokens ÷ Σ wall time (prefill
included, timed around each call with torch.cuda.synchronize). Every divergence from `ar` is listed
with the target's top-2 margin there. `--budget-seconds` stops starting prompts when the next one
would not fit; the table says how many were done.

(iv) PROJECTION, random weights: a Qwen3-8B-shaped target (bf16), timed forward of 1 and K+1 tokens
after a `--prefix`-token KV cache (eager: DynamicCache, as the engine verifies; graph: StaticCache +
an explicit 4-D mask, one CUDA graph per shape, checked against eager); a 5-layer DFlash draft block
of K+1 slots (docs/design.md §4 shapes, `--context-rows` target rows appended first) plus its base logits;
the head rollout from `--head-json` (benchmarks/head_kernels_gpu.py, row `--head-row`; K = 7 scaled
by corrected steps) or timed here (Triton + graph). Projected speed-up = τ · t_AR ÷ (t_draft + t_head
+ t_verify(K)), τ in {2, 3, 4, 5}, K in {7, 15}: a model, not a measurement.

Prints progress lines, then markdown tables last; writes JSON to --out after each part. Exit 1 if
a part failed or a graph check failed. Needs torch, transformers (+ gguf for the target), triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from common.cli import load_target
from common.generate import StaticGenerate
from common.prompts import interleave, pack_suites, read_prompts
from common.random_head import HEAD_SHAPES, head_rollouts, random_head
from common.random_models import QWEN3_8B, building, random_target
from common.record import environment, require_cuda, write_json
from common.timing import capture, log, median_ms, sync
from common.cli import parser as make_parser

MODES = ("ar", "graph ar", "ngram", "dflash", "dflash+fork", "domino", "domino+ngram", "domino+fork", "dominotree+fork",
         "ar graphs", "ngram graphs", "dflash graphs", "dflash+fork graphs", "domino graphs", "domino+ngram graphs",
         "domino+fork graphs", "dominotree+fork graphs", "ar lean", "ngram lean", "dflash lean", "dflash+fork lean",
         "domino lean", "domino+ngram lean", "domino+fork lean", "dominotree+fork lean")
GRAPHED = ("ar lean", "ar graphs")  # our CUDA-graph AR (the lean decoder's when it ran): the baseline of the graph'd modes
TAUS = (2, 3, 4, 5)
GRAPH_AR_STATE = {True: "compiled", False: "NOT compiled", None: "not run"}
SMOKE_QWEN3 = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


# ---------------------------------------------------------------------------------------------
# (ii) end to end
# ---------------------------------------------------------------------------------------------


def smoke_models(device: torch.device):
    """Tiny random Llama target (word-level tokenizer, EOS 2) and a tiny Domino draft for it, fp32."""
    from transformers import LlamaConfig

    from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig

    V, L = 128, 4
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=True)
    # peaked next-token distributions (std 0.25): loops, so lookups and drafts get accepted
    target = random_target(config, device=device, std=0.25, name="smoke")
    identity = target.identity
    draft = DFlashDraftModel(DominoDraftConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, block_size=8, num_target_layers=L, emb_dim=8, target=identity.as_dict(),
        dflash_config=dict(mask_token_id=V - 1, target_layer_ids=[0, L - 2], gru_hidden_dim=16, emb_dim=8)))
    return target, draft.to(device).eval().requires_grad_(False)


def load_prompts(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """--suite-from-study / --prompts / --smoke -> {suite: [prompt ids]}, at most --max-prompts per suite."""
    if args.smoke:
        g = torch.Generator().manual_seed(1)
        suites = {s: [torch.randint(3, 120, (int(n),), generator=g).tolist() for n in torch.randint(4, 24, (3,), generator=g)]
                  for s in ("smoke-a", "smoke-b")}
    elif args.suite_from_study:
        suites = pack_suites(args.suite_from_study)
    else:
        suites = read_prompts(args.prompts)
    return {name: ps[: args.max_prompts] for name, ps in suites.items() if ps}


def load_e2e(args: argparse.Namespace, device: torch.device):
    """-> (target, draft) for the e2e part."""
    if args.smoke:
        return smoke_models(device)
    from dominospec.config import load_params
    from dominospec.draft import load_draft

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    target = load_target(load_params(args.params), args.gguf_dir, dtype)
    return target, load_draft(args.draft, target)


def tree_mode(nodes: int, budgets: list[int]) -> str:
    """The name of DominoTree + fork at a node budget: "dominotree+fork" when one budget is run, else
    "dominotree<N>+fork" (suffixes " graphs" / " lean" follow)."""
    return "dominotree+fork" if len(budgets) == 1 else f"dominotree{nodes}+fork"


def all_modes(budgets: list[int]) -> list[str]:
    """MODES with "dominotree+fork" expanded to one mode per node budget."""
    return expand_modes(list(MODES), budgets)


def expand_modes(wanted: list[str], budgets: list[int]) -> list[str]:
    """Asked-for modes -> mode names; "dominotree+fork[ suffix]" means every budget's."""
    out = []
    for mode in wanted:
        base, _, suffix = mode.strip().partition(" ")
        names = [tree_mode(n, budgets) for n in budgets] if base == "dominotree+fork" else [base]
        out += [f"{name} {suffix}".strip() for name in names]
    return out


def run_e2e(args: argparse.Namespace, deadline: float, result: dict, key: str = "e2e") -> None:
    """Fills result[key]: settings, per-prompt records, per-mode summaries, divergences; then, with
    --temperature, result[key + "_sampled"]: the sampled pass of --sampled-modes on the same prompts."""
    from common.cli import plain_engine
    from dominospec.config import load_params
    from dominospec.engine import SpecEngine
    from dominospec.eval.report import first_divergence, pooled, top2_margin

    cuda = torch.cuda.is_available() and (not args.smoke or args.smoke_on_gpu)
    device = torch.device("cuda" if cuda else "cpu")
    target, draft = load_e2e(args, device)
    suites = load_prompts(args)
    plan = interleave(suites)
    options = plain_engine(load_params(args.params).engine, head_kernel="triton" if cuda else "torch",
                           candidate_pool=args.pool)
    graphed = dataclasses.replace(options, cuda_graphs="on" if cuda else "static", graph_capacity=args.graph_capacity)
    lean = dataclasses.replace(graphed, lean_target="on")
    engines = {}
    for suffix, opts in (("", options), (" graphs", graphed), (" lean", lean)):
        engines.update({
            "ar" + suffix: SpecEngine(target, None, "ar", None, opts),
            "ngram" + suffix: SpecEngine(target, None, "ngram", "auto" if args.num_draft == "auto" else None, opts),
            "dflash" + suffix: SpecEngine(target, draft, "dflash", args.num_draft, opts),
            "dflash+fork" + suffix: SpecEngine(target, draft, "dflash", args.num_draft,
                                               dataclasses.replace(opts, ngram_assist=True, ngram_fork=True)),
            "domino" + suffix: SpecEngine(target, draft, "domino", args.num_draft, opts),
            "domino+ngram" + suffix: SpecEngine(target, draft, "domino", args.num_draft,
                                                dataclasses.replace(opts, ngram_assist=True)),
            "domino+fork" + suffix: SpecEngine(target, draft, "domino", args.num_draft,
                                               dataclasses.replace(opts, ngram_assist=True, ngram_fork=True)),
        })
        for nodes in args.tree_nodes:  # one engine per node budget
            engines[tree_mode(nodes, args.tree_nodes) + suffix] = SpecEngine(
                target, draft, "dominotree", args.num_draft,
                dataclasses.replace(opts, ngram_assist=True, ngram_fork=True).with_tree(nodes=nodes,
                                                                                        children=args.tree_children))
    wanted = set(expand_modes(args.modes.split(","), args.tree_nodes)) | {args.reference} | (
        {"graph ar"} if args.graph_ar else set())
    if any(m.endswith(" graphs") for m in wanted):
        wanted.add("ar graphs")
    if any(m.endswith(" lean") for m in wanted):
        wanted.add("ar lean")
    modes = [m for m in all_modes(args.tree_nodes) if m in wanted]
    engines = {m: e for m, e in engines.items() if m in wanted}
    e2e = result[key] = dict(
        target=target.identity.name, dtype=str(target.embed_tokens.weight.dtype).replace("torch.", ""),
        block_size=draft.config.block_size, num_draft=args.num_draft or draft.config.block_size - 1,
        ngram_num_draft=options.ngram_num_draft, modes=modes, graph_capacity=args.graph_capacity, candidate_pool=args.pool, head_kernel=options.head_kernel,
        temperature=0.0, batch=1, max_new_tokens=args.new_tokens, reference=args.reference, suites={k: len(v) for k, v in suites.items()},
        prompts_planned=len(plan), prompts_done=0, records=[])
    log(f"e2e: {target.identity.name} {e2e['dtype']} on {device}, B = {e2e['block_size']}, K = {e2e['num_draft']}, "
        f"{len(plan)} prompts planned ({e2e['suites']}), {args.new_tokens} new tokens")
    tick = time.perf_counter()
    longest = max(len(p) for _, p in plan) + args.new_tokens
    for engine in engines.values():  # warm-up: allocations, Triton compiles, graph captures (every shape of a round)
        engine.capture(longest + max(engine.block_size, engine.max_verify) + 1)
        engine.generate(plan[0][1], 2 * e2e["block_size"])
        engine.generate(plan[-1][1], 4 * e2e["block_size"])
    e2e["graph_failures"] = {m: e.graph_failures() for m, e in engines.items() if e.graph_failures()}
    log(f"e2e: engines warm in {time.perf_counter() - tick:.1f} s; graph capture failures: "
        f"{e2e['graph_failures'] or 'none'}")
    stops = sorted(next(iter(engines.values())).stop_ids)
    graph = None
    if "graph ar" in modes:
        graph = StaticGenerate(target, stops, max((p for _, p in plan), key=len), args.new_tokens,
                               kept=args.graph_ar_cache == "kept")
        e2e.update(graph_ar_compiled=graph.compiled, graph_ar_warmup_s=round(graph.warmup_s, 1))
        log(f"e2e: warm, graph ar {'compiled (CUDA graphs)' if graph.compiled else 'NOT compiled (static cache only)'} "
            f"in {graph.warmup_s:.1f} s")

    gens: dict[str, list] = {m: [] for m in engines}
    started = time.perf_counter()
    for i, (suite, prompt) in enumerate(plan):
        if i and time.perf_counter() + (time.perf_counter() - started) / i > deadline:
            log(f"e2e: budget reached, {i} of {len(plan)} prompts done")
            break
        runs: dict[str, dict] = {}
        for engine in engines.values():  # untimed: this prompt length's first-call costs (kernel picks, compiles)
            engine.generate(prompt, 2)
        if graph is not None:  # compiled generate is warmed on the prompt alike
            graph(prompt, 2)
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # the order rotates: no mode always goes first
            sync(cuda)
            tick = time.perf_counter()
            if mode == "graph ar" and graph is not None:
                tokens, stats = graph(prompt, args.new_tokens), None
            else:
                g = engines[mode].generate(prompt, args.new_tokens)
                tokens, stats = g.token_ids, g.stats
                gens[mode].append(g)
            sync(cuda)
            seconds = time.perf_counter() - tick
            rounds = stats.rounds if stats else len(tokens) - 1  # graph ar: one forward per token after the prefill
            runs[mode] = dict(tokens=tokens, seconds=seconds, rounds=rounds,
                              round_tokens=stats.round_tokens if stats else len(tokens) - 1)
        reference = runs[args.reference]["tokens"]
        for mode, run in runs.items():
            j = first_divergence(reference, run["tokens"])
            run["divergence"] = j
            if j is not None and j < len(reference):  # the target's top-2 margin where they part (near-tie?)
                run["margin"] = round(top2_margin(engines[args.reference], prompt + reference[:j]), 4)
            if mode.endswith((" graphs", " lean")):  # lossless within the graph'd path: equal to our graph AR
                baseline = "ar lean" if mode.endswith(" lean") else "ar graphs"
                run["divergence_graphs"] = first_divergence(runs[baseline]["tokens"], run["tokens"])
            if mode in engines:
                run["static_cache"] = gens[mode][-1].stats.static_cache
        e2e["records"].append(dict(suite=suite, prompt_tokens=len(prompt), runs=runs))
        e2e["prompts_done"] = i + 1
        log(f"e2e: prompt {i + 1}/{len(plan)} ({suite}, {len(prompt)} tokens): " + ", ".join(
            f"{m} {len(r['tokens']) / r['seconds']:.0f} tok/s" + (" ≠ar" if r["divergence"] is not None else "")
            for m, r in runs.items()))
    e2e["summary"] = {"all": summarize(e2e["records"])}
    for suite in suites:
        e2e["summary"][suite] = summarize([r for r in e2e["records"] if r["suite"] == suite])
    for mode, gs in gens.items():  # per-round phase costs of the engine's own modes (ms)
        if gs and not mode.startswith("ar"):
            p = pooled(gs)
            e2e["summary"]["all"][mode].update({k: p[k] for k in (
                "draft_ms_per_round", "rollout_ms_per_round", "verify_ms_per_round", "mean_drafts_per_round",
                "lookup_round_share", "fork_round_share", "fork_lookup_win_share", "tree_round_share",
                "tree_side_win_share", "host_ms_per_round", "wall_ms_per_round")})
        elif gs:
            p = pooled(gs)
            e2e["summary"]["all"][mode].update(ms_per_step=p["verify_ms_per_round"], host_ms_per_round=p["host_ms_per_round"],
                                               wall_ms_per_round=p["wall_ms_per_round"])
    e2e["cost_ms"] = {mode: e.cost.as_dict() for mode, e in engines.items() if e.cost is not None}  # auto-K's tables
    try:  # did the graph ar recompile or break? (torch.compile's own counters)
        from torch._dynamo.utils import counters
        e2e["dynamo_counters"] = {k: dict(counters[k]) for k in ("stats", "recompiles", "graph_break") if k in counters}
    except ImportError:
        pass
    for r in e2e["records"]:
        for run in r["runs"].values():
            del run["tokens"]  # keep the JSON small; the divergences stay
    if args.temperature:
        result[key + "_sampled"] = run_sampled(args, engines, plan, time.perf_counter() + args.sampled_seconds)


ROUND_COSTS = ("draft_ms_per_round", "rollout_ms_per_round", "verify_ms_per_round", "host_ms_per_round", "wall_ms_per_round")


def run_sampled(args: argparse.Namespace, engines: dict, plan: list, deadline: float) -> dict:
    """The --sampled-modes at --temperature on the same prompts, interleaved, each prompt seeded alike
    for every mode -> τ, tokens/s and × the first mode (our AR, sampled). Lossless sampling is
    checked by the chi-square tests on the CPU; here only the speed is measured."""
    from dominospec.engine import Sampling
    from dominospec.eval.report import pooled

    sampling = Sampling(temperature=args.temperature)
    modes = [m for m in expand_modes(args.sampled_modes.split(","), args.tree_nodes) if m in engines]
    for mode in modes:  # the sampled shapes' graphs (the tree's grower per (K, sampling)) before timing
        engines[mode].generate(plan[0][1], 4 * engines[mode].block_size, sampling=sampling, seed=0)
    gens: dict[str, list] = {m: [] for m in modes}
    seconds = {m: 0.0 for m in modes}
    cuda = torch.cuda.is_available()
    for i, (_, prompt) in enumerate(plan):
        if time.perf_counter() > deadline:
            log(f"sampled: budget reached, {i} of {len(plan)} prompts done")
            break
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # rotated, as in the greedy pass
            sync(cuda)
            tick = time.perf_counter()
            gens[mode].append(engines[mode].generate(prompt, args.new_tokens, sampling=sampling, seed=1000 + i))
            sync(cuda)
            seconds[mode] += time.perf_counter() - tick
    out = dict(temperature=args.temperature, modes=modes, prompts=len(gens[modes[0]]) if modes else 0, summary={})
    for mode in modes:
        new = sum(len(g.token_ids) for g in gens[mode])
        p = pooled(gens[mode])
        out["summary"][mode] = dict(tau=p["acceptance_length"], tau_se=p["acceptance_length_se"], new_tokens=new, seconds=round(seconds[mode], 3),
                                    tokens_per_s=new / seconds[mode] if seconds[mode] else None,
                                    **{k: p[k] for k in ROUND_COSTS})  # where a sampled round's time goes
    base = out["summary"][modes[0]]["tokens_per_s"] if modes else None
    for m in out["summary"].values():
        m["speedup_vs_first"] = m["tokens_per_s"] / base if base and m["tokens_per_s"] else None
    log(f"sampled T = {args.temperature}: " + ", ".join(f"{m} τ {v['tau']:.2f} {v['tokens_per_s']:.0f} tok/s"
                                                      for m, v in out["summary"].items()))
    return out


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per-prompt records -> per mode: prompts, τ (pooled) ± SE, tokens/s, speed-ups, exact share, divergences."""
    from dominospec.eval.report import tau_standard_error

    out: dict[str, dict] = {}
    if not records:
        return out
    for mode in records[0]["runs"]:
        runs = [r["runs"][mode] for r in records]
        rounds = sum(x["rounds"] for x in runs)
        seconds = sum(x["seconds"] for x in runs)
        new = sum(len(x["tokens"]) for x in runs)
        as_gens = [SimpleNamespace(stats=SimpleNamespace(round_tokens=x["round_tokens"], rounds=x["rounds"])) for x in runs]
        out[mode] = dict(prompts=len(runs), new_tokens=new, seconds=round(seconds, 3),
                         tau=sum(x["round_tokens"] for x in runs) / rounds if rounds else None,
                         tau_se=tau_standard_error(as_gens), tokens_per_s=new / seconds if seconds else None,
                         exact=sum(x["divergence"] is None for x in runs) / len(runs),
                         exact_vs_graphs=(sum(x["divergence_graphs"] is None for x in runs) / len(runs)
                                          if "divergence_graphs" in runs[0] else None),
                         static_cache_share=(sum(bool(x.get("static_cache")) for x in runs) / len(runs)),
                         divergences=[dict(prompt=i, at=x["divergence"], margin=x.get("margin"))
                                      for i, x in enumerate(runs) if x["divergence"] is not None])
    for mode, m in out.items():
        m["speedup_vs_ar"] = m["tokens_per_s"] / out["ar"]["tokens_per_s"] if "ar" in out else None
        m["speedup_vs_graph_ar"] = m["tokens_per_s"] / out["graph ar"]["tokens_per_s"] if "graph ar" in out else None
        ours = next((out[g] for g in GRAPHED if g in out), None)
        m["speedup_vs_our_graph_ar"] = m["tokens_per_s"] / ours["tokens_per_s"] if ours else None
    return out


# ---------------------------------------------------------------------------------------------
# (iv) projection for Qwen3-8B
# ---------------------------------------------------------------------------------------------


def close(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Logits a, b [T, V] -> max |a - b| relative to max |b|, and the share of rows with the same argmax."""
    a, b = a.float(), b.float()
    return dict(rel_diff=float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)),
                argmax_agree=float((a.argmax(-1) == b.argmax(-1)).float().mean()))


@torch.inference_mode()
def time_target(model: Any, prefix: int, shapes: list[int], reps: int, cuda: bool) -> dict:
    """Forward of T tokens after a `prefix`-row KV cache -> {T: {eager_ms, graph_ms, checks}}.
    eager: DynamicCache (the engine's verify), cropped back after each call. graph: StaticCache and an
    explicit 4-D mask, captured per T at positions prefix..prefix+T-1 (rewound before each replay)."""
    from transformers import DynamicCache

    from dominospec.runtime.kv import cache_argument, crop_kv

    device = next(model.parameters()).device
    V = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    prefix_ids = torch.randint(V, (1, prefix), generator=g).to(device)
    ids = {T: torch.randint(V, (1, T), generator=g).to(device) for T in shapes}
    arg = cache_argument(model)
    dyn = DynamicCache()
    model(input_ids=prefix_ids, **{arg: dyn}, use_cache=True, logits_to_keep=1)
    out: dict[int, dict] = {}
    reference = {}
    for T in shapes:
        def eager(T=T):
            return model(input_ids=ids[T], **{arg: dyn}, use_cache=True, logits_to_keep=T).logits[0]
        crop_kv(dyn, prefix)  # the timing loop leaves the last call's rows
        reference[T] = eager().clone()
        crop_kv(dyn, prefix)
        out[T] = dict(eager_ms=median_ms(eager, reps, cuda, before=lambda: crop_kv(dyn, prefix)))

    try:
        time_static(model, prefix_ids, ids, out, reference, reps, cuda)
    except Exception:  # the eager times still make a projection
        out["static_error"] = traceback.format_exc()
        log(f"projection: static cache / graph path FAILED:\n{out['static_error']}")
    return out


def time_static(model: Any, prefix_ids: torch.Tensor, ids: dict, out: dict, reference: dict, reps: int,
                cuda: bool) -> None:
    """The static-cache half of `time_target`: fills out[T] with static_eager_ms, graph_ms and the checks."""
    import inspect

    from transformers import StaticCache

    from dominospec.runtime.kv import cache_argument

    device, prefix, arg = prefix_ids.device, prefix_ids.shape[1], cache_argument(model)
    L = prefix + max(ids)
    static = StaticCache(config=model.config, max_cache_len=L)
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def rewind(n: int) -> None:  # transformers >= 5.2x: the write position is a tensor counter per layer
        for layer in getattr(static, "layers", []):
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length.fill_(n)

    def forward(x: torch.Tensor, start: int) -> Callable[[], torch.Tensor]:
        T = x.shape[1]
        pos = torch.arange(start, start + T, device=device)[None]  # [1, T]
        mask = (torch.arange(L, device=device)[None, :] <= pos[0][:, None])[None, None]  # [1, 1, T, L] bool, True = attend
        kw = {arg: static, "position_ids": pos, "attention_mask": mask, "use_cache": True, "logits_to_keep": T}
        if takes_cache_position:  # older transformers write the static cache at cache_position
            kw["cache_position"] = pos[0]
        return lambda: model(input_ids=x, **kw).logits[0]

    forward(prefix_ids, 0)()  # prefill, eager
    for T in ids:
        fn = forward(ids[T], prefix)
        rewind(prefix)
        static_eager = fn().clone()
        out[T]["static_vs_dynamic"] = close(static_eager, reference[T])
        out[T]["static_eager_ms"] = median_ms(fn, reps, cuda, before=lambda: rewind(prefix))
        if cuda:
            replay, graph_out = capture(fn, before=lambda: rewind(prefix))
            rewind(prefix)
            replay()
            sync(cuda)
            out[T]["graph_equal_static_eager"] = bool(torch.equal(graph_out, static_eager))
            out[T]["graph_vs_dynamic"] = close(graph_out, reference[T])
            out[T]["graph_ms"] = median_ms(replay, reps, cuda, before=lambda: rewind(prefix))
        rewind(prefix)


@torch.inference_mode()
def time_draft(draft: Any, lm_head: Any, prefix: int, rows: int, shapes: list[int], reps: int, cuda: bool) -> dict:
    """Draft block of Q = K+1 slots after `prefix` context rows, `rows` new target rows appended first,
    + base logits of K slots (the engine's `_draft_forward`) -> {Q: {eager_ms, graph_ms, graph_equal}}."""
    from dominospec.models.domino import DraftContextCache

    device, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    H, F = draft.config.hidden_size, draft.fc.weight.shape[1]
    g = torch.Generator(device="cpu").manual_seed(1)
    context = DraftContextCache(len(draft.layers))
    draft.extend_context(torch.randn(1, prefix, F, generator=g).to(device, dtype), context)
    features = torch.randn(1, rows, F, generator=g).to(device, dtype)
    out = {}
    for Q in shapes:
        block = torch.randn(1, Q, H, generator=g).to(device, dtype)
        positions = torch.arange(prefix + rows, prefix + rows + Q, device=device)[None]

        def step(block=block, positions=positions, Q=Q):
            cache = DraftContextCache(len(draft.layers))  # a fresh view of the prefix: appends never accumulate
            cache.keys, cache.values = list(context.keys), list(context.values)
            z = draft(block, positions, target_features=features, cache=cache)[0, : Q - 1]  # [K, H]
            return lm_head(z)  # base logits u [K, V]
        out[Q] = dict(eager_ms=median_ms(step, reps, cuda))
        if cuda:
            try:
                eager = step().clone()
                replay, graph_out = capture(step)
                replay()
                sync(cuda)
                out[Q].update(graph_equal=bool(torch.equal(graph_out, eager)), graph_ms=median_ms(replay, reps, cuda))
            except Exception:
                out[Q]["graph_error"] = traceback.format_exc()
                log(f"projection: draft graph FAILED:\n{out[Q]['graph_error']}")
    return out


def head_times(args: argparse.Namespace, Ks: list[int], cuda: bool) -> dict:
    """K -> head rollout ms and where it came from: --head-json (scaled by corrected steps), or timed here."""
    if args.head_json:
        data = json.loads(Path(args.head_json).read_text())
        row = next(r for r in data["rows"] if r["path"] == args.head_row)
        Kj, P = data["shapes"]["num_draft"], data["shapes"]["prefix"]
        return {K: dict(ms=row["ms"] * (K - P) / (Kj - P), source=f"{args.head_json}: {args.head_row}, K={Kj}"
                        + ("" if K == Kj else f", scaled by corrected steps {K - P}/{Kj - P}")) for K in Ks}
    out = {}
    for K in Ks:
        s = dict(HEAD_SHAPES["qwen3-8b" if cuda else "smoke"], num_draft=K)
        w = random_head(s, torch.bfloat16 if cuda else torch.float32, torch.device("cuda" if cuda else "cpu"))
        paths = head_rollouts(w, s, None, 2 << 30)
        if cuda:
            replay, _ = capture(paths["triton"])
            out[K] = dict(ms=median_ms(replay, args.reps, cuda), source="timed here: triton + graph (GRU table)")
        else:
            out[K] = dict(ms=median_ms(paths["torch"], args.reps, cuda), source="timed here: torch eager (smoke)")
        del w, paths
    return out


def run_projection(args: argparse.Namespace, result: dict) -> None:
    """Fills result["projection"]: component times (ms) and projected speed-ups by (K, setting, τ)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig

    cuda = torch.cuda.is_available() and (not args.smoke or args.smoke_on_gpu)
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    Ks = [7, 15]
    shapes = [1] + [K + 1 for K in Ks]
    prefix = args.prefix if not args.smoke else 48
    proj = result["projection"] = dict(label="PROJECTION (random weights, modelled round; not a measurement)",
                                       shapes="smoke (tiny)" if args.smoke else "Qwen3-8B",
                                       target=QWEN3_8B if not args.smoke else SMOKE_QWEN3,
                                       dtype=str(dtype).replace("torch.", ""),
                                       prefix=prefix, context_rows=args.context_rows, reps=args.reps)
    tick = time.perf_counter()
    with building(device, dtype):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**{"tie_word_embeddings": False, **proj["target"]}))
        n = proj["target"]["num_hidden_layers"]
        layer_ids = [1, 9, 17, 25, 33] if not args.smoke else [0, 2]
        cfg = dict(block_size=16, num_target_layers=n, dflash_config=dict(target_layer_ids=layer_ids))
        if args.smoke:
            cfg.update(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, dflash_config=dict(target_layer_ids=layer_ids, gru_hidden_dim=32, emb_dim=16))
        draft = DFlashDraftModel(DominoDraftConfig(**cfg))  # defaults: docs/design.md §4 (5 layers, H 4096, G 1024, r 256)
    model.eval().requires_grad_(False)
    draft.eval().requires_grad_(False)
    proj["draft_layers"] = len(draft.layers)
    proj["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    log(f"projection: built target + draft in {time.perf_counter() - tick:.1f} s ({proj['attn_implementation']})")
    proj["target_ms"] = time_target(model, prefix, shapes, args.reps, cuda)
    log(f"projection: target {json.dumps(proj['target_ms'])}")
    proj["draft_ms"] = time_draft(draft, model.get_output_embeddings(), prefix, args.context_rows,
                                  [K + 1 for K in Ks], args.reps, cuda)
    log(f"projection: draft {json.dumps(proj['draft_ms'])}")
    del model, draft
    if cuda:
        torch.cuda.empty_cache()
    proj["head_ms"] = head_times(args, Ks, cuda)
    log(f"projection: head {json.dumps(proj['head_ms'])}")
    rows = []
    for K in Ks:
        for setting, key in (("graph", "graph_ms"), ("eager", "eager_ms")):
            t, d = proj["target_ms"], proj["draft_ms"][K + 1]
            if not all(key in x for x in (t[1], t[K + 1], d)):
                continue
            t_round = d[key] + proj["head_ms"][K]["ms"] + t[K + 1][key]
            rows.append(dict(K=K, setting=setting, t_ar=t[1][key], t_draft=d[key], t_head=proj["head_ms"][K]["ms"],
                             t_verify=t[K + 1][key], t_round=t_round,
                             speedup={tau: tau * t[1][key] / t_round for tau in TAUS}))
    proj["rows"] = rows
    checks = [v for v in proj["target_ms"].values() if isinstance(v, dict)]
    proj["ok"] = (all(v.get("graph_equal_static_eager", True) and v.get("static_vs_dynamic", {}).get("rel_diff", 0) < 0.05
                      for v in checks) and all(v.get("graph_equal", True) for v in proj["draft_ms"].values()))
    proj["seconds"] = round(time.perf_counter() - tick, 1)


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def fmt(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def e2e_table(result: dict, key: str) -> list[str]:
    """The end-to-end part result[key] -> its markdown table's lines (none when it did not run)."""
    e2e = result.get(key)
    if not (e2e and "summary" in e2e):
        return []
    lines: list[str] = [""] if key != "e2e" else []
    s = e2e["summary"]
    suites = [k for k in s if k != "all"]
    lines += [f"(ii) end to end ({key}): {e2e['target']} {e2e['dtype']}, {result['device']}, greedy, batch 1, "
              f"{e2e['max_new_tokens']} new tokens, B = {e2e['block_size']}, K = {e2e['num_draft']} "
              f"(ngram {e2e['ngram_num_draft']}), pool {e2e['candidate_pool']}, head {e2e['head_kernel']}; "
              f"{e2e['prompts_done']} of {e2e['prompts_planned']} prompts ({', '.join(suites)}); graph ar "
              f"{GRAPH_AR_STATE[e2e.get('graph_ar_compiled')]}", "",
              f"| mode | τ ± SE | τ {' / '.join(suites)} | tokens/s | × eager AR | × HF graph AR | × our graph AR "
              f"| exact vs {e2e.get('reference', 'ar')} | exact vs our graph AR | divergences (at, top-2 margin) | "
              "device: draft / chain / verify ms per round | host: plan / launch / wait / commit ms | wall ms per round |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in s["all"].items():
        by_suite = " / ".join(fmt(s[k][mode]["tau"]) if mode in s[k] else "–" for k in suites)
        div = "; ".join(f"{d['at']}, {d['margin']}" for d in m["divergences"][:4]) + (" …" if len(m["divergences"]) > 4 else "")
        phases = " / ".join(fmt(m.get(k)) for k in ("draft_ms_per_round", "rollout_ms_per_round", "verify_ms_per_round")) \
            if "verify_ms_per_round" in m else (f"step {fmt(m['ms_per_step'])}" if "ms_per_step" in m else "")
        exact_g = "–" if m.get("exact_vs_graphs") is None else f"{100 * m['exact_vs_graphs']:.0f} %"
        host = " / ".join(fmt(v) for v in m["host_ms_per_round"].values()) if m.get("host_ms_per_round") else ""
        lines.append(f"| {mode} | {fmt(m['tau'])} ± {fmt(m['tau_se'])} | {by_suite} | {fmt(m['tokens_per_s'], 1)} | "
                     f"{fmt(m['speedup_vs_ar'])} | {fmt(m['speedup_vs_graph_ar'])} | {fmt(m.get('speedup_vs_our_graph_ar'))} | "
                     f"{100 * m['exact']:.0f} % | {exact_g} | {div} | {phases} | {host} | {fmt(m.get('wall_ms_per_round'))} |")
    return lines


def tables(result: dict) -> str:
    lines = []
    for key in ("e2e", "e2e_fp32"):
        lines += e2e_table(result, key)
        sampled = result.get(key + "_sampled")
        if sampled and sampled.get("summary"):
            lines += ["", f"sampled, T = {sampled['temperature']}, {sampled['prompts']} prompts, the same seeds per prompt", "",
                      "| mode | τ ± SE | tokens/s | × " + sampled["modes"][0] + " | device: draft / chain / verify ms per "
                      "round | host: plan / launch / wait / commit ms | wall ms per round |", "|---|---|---|---|---|---|---|"]
            for mode, m in sampled["summary"].items():
                phases = " / ".join(fmt(m.get(k)) for k in ROUND_COSTS[:3])
                host = " / ".join(fmt(v) for v in m["host_ms_per_round"].values()) if m.get("host_ms_per_round") else ""
                lines.append(f"| {mode} | {fmt(m['tau'])} ± {fmt(m['tau_se'])} | {fmt(m['tokens_per_s'], 1)} | "
                             f"{fmt(m['speedup_vs_first'])} | {phases} | {host} | {fmt(m.get('wall_ms_per_round'))} |")
    proj = result.get("projection")
    if proj and "rows" in proj:
        lines += ["", f"(iv) {proj['label']}: {proj['shapes']} shapes, {proj['dtype']}, KV prefix {proj['prefix']}, "
                  f"{proj['draft_layers']}-layer draft of K+1 slots, head: {proj['head_ms'][15]['source']}", "",
                  "| K | setting | t_AR ms | t_draft ms | t_head ms | t_verify(K) ms | round ms | "
                  + " | ".join(f"proj. × at τ={t}" for t in TAUS) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(TAUS)]
        for r in proj["rows"]:
            lines.append(f"| {r['K']} | {r['setting']} | {r['t_ar']:.3f} | {r['t_draft']:.3f} | {r['t_head']:.3f} | "
                         f"{r['t_verify']:.3f} | {r['t_round']:.3f} | " + " | ".join(fmt(r["speedup"][t]) for t in TAUS) + " |")
    for part in ("e2e", "e2e_fp32", "projection"):
        if result.get(f"{part}_error"):
            lines += ["", f"{part} FAILED: {result[f'{part}_error'].strip().splitlines()[-1]}"]
    return "\n".join(lines)


def main() -> None:
    parser = make_parser(__doc__, new_tokens=256)
    parser.add_argument("--out", required=True, help="JSON result path")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny random models, few tokens")
    parser.add_argument("--smoke-on-gpu", action="store_true", help="the smoke run's tiny models on CUDA (graph capture check)")
    parser.add_argument("--gguf-dir", help="folder holding SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--draft", help="trained draft dir (HF layout)")
    parser.add_argument("--suite-from-study", help="packed file of benchmarks/draft_study.py pack (its suites)")
    parser.add_argument("--prompts", help=".pt list (or {suite: list}) of ids, or JSONL of {prompt_ids, suite?}")
    parser.add_argument("--max-prompts", type=int, default=16, help="per suite")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="auto: bf16 on CUDA")
    parser.add_argument("--num-draft", type=lambda v: v if v == "auto" else int(v), default=None,
                        help="K of the draft modes (default B - 1), or auto: auto-K, its cost measured on the first prompt")
    parser.add_argument("--pool", type=int, default=0, help="candidate pool M (0 = full vocabulary)")
    parser.add_argument("--tree-nodes", type=lambda v: [int(n) for n in v.split(",")], default=[28],
                        help="dominotree+fork: the best-first tree's node budget N, or several (64,128,256: one mode each)")
    parser.add_argument("--tree-children", type=int, default=4, help="dominotree+fork: children offered per expansion")
    parser.add_argument("--graph-capacity", type=int, default=2048, help="rows of the graph modes' static caches")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes (the reference and graph ar always run)")
    parser.add_argument("--reference", default="ar", help="the mode every other is checked against token for token "
                        "(ar: HF eager; `ar lean` spares eager's minutes in bf16, where no speculative mode is exact anyway)")
    parser.add_argument("--budget-seconds", type=float, default=540)
    parser.add_argument("--prefix", type=int, default=1000, help="(iv) KV rows before the timed forwards")
    parser.add_argument("--context-rows", type=int, default=4, help="(iv) target rows appended to the draft context per round")
    parser.add_argument("--reps", type=int, default=30, help="(iv) timed calls per shape (median)")
    parser.add_argument("--head-json", help="(iv) JSON of benchmarks/head_kernels_gpu.py")
    parser.add_argument("--head-row", default="triton + graph", help="(iv) its row used as the head time")
    parser.add_argument("--no-graph-ar", dest="graph_ar", action="store_false",
                        help="leave out transformers' compiled generate (it always runs otherwise)")
    parser.add_argument("--graph-ar-cache", choices=["kept", "fresh"], default="kept",
                        help="compiled generate's static cache: one kept and reset per call, or generate's own "
                             "(a new one a call: its recorded graphs write into the freed last one)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="after the greedy pass, the --sampled-modes at this temperature on the same prompts")
    parser.add_argument("--sampled-seconds", type=float, default=120, help="the sampled pass's own time budget")
    parser.add_argument("--sampled-modes", default="ar lean,domino+fork lean,dominotree+fork lean",
                        help="the sampled pass's modes; the first is the baseline of its speed-ups")
    parser.add_argument("--fp32-prompts", type=int, default=0,
                        help="then an fp32 pass of the --fp32-modes on this many prompts a suite, checked token for "
                             "token against our lean AR in fp32")
    parser.add_argument("--fp32-modes", default="ar lean,domino+fork lean,dominotree+fork lean")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-projection", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.new_tokens, args.reps = min(args.new_tokens, 24), min(args.reps, 3)
    else:
        require_cuda()
    if not args.smoke and not args.skip_e2e and not (args.gguf_dir and args.draft and (args.suite_from_study or args.prompts)):
        sys.exit("error: the e2e part needs --gguf-dir, --draft and --suite-from-study or --prompts (or --skip-e2e)")
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and (not args.smoke or args.smoke_on_gpu)
    result: dict[str, Any] = dict(**environment(cuda, draft=None if args.smoke else args.draft), smoke=args.smoke,
                                  budget_seconds=args.budget_seconds)
    fp32 = argparse.Namespace(**{**vars(args), "dtype": "float32", "max_prompts": args.fp32_prompts, "temperature": 0.0,
                                 "modes": args.fp32_modes, "reference": "ar lean", "graph_ar": False})
    for part, skip, fn in (("projection", args.skip_projection, lambda: run_projection(args, result)),
                           ("e2e", args.skip_e2e, lambda: run_e2e(args, started + args.budget_seconds - 10, result)),
                           ("e2e_fp32", args.skip_e2e or not args.fp32_prompts,
                            lambda: run_e2e(fp32, started + args.budget_seconds + 10 ** 6, result, "e2e_fp32"))):
        if skip:
            continue
        try:
            fn()
        except Exception:  # record and go on: the other part is still worth having
            result[f"{part}_error"] = traceback.format_exc()
            log(f"{part} FAILED:\n{result[f'{part}_error']}")
        write_json(args.out, result)
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json(args.out, result)
    print(f"\n{result['device']}, torch {result['torch']}, transformers {result['transformers']}, triton {result['triton']}, "
          f"{result['date']}, {result['seconds']} s; JSON: {args.out}\n")
    print(tables(result))
    failed = any(result.get(f"{p}_error") for p in ("e2e", "e2e_fp32", "projection")) or not result.get("projection", {}).get("ok", True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
