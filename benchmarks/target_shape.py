"""A named public target shape on one GPU with random weights: its checkpoint, the engine's costs, a projection.

Qwen3-8B's weights cannot be downloaded here, but its shapes and its tokenizer can be had, and a
decoding step's cost does not depend on the weights' values. τ does: on random weights it is
meaningless (about 1), so nothing here reports one; the speed-ups are a projection at given τ.

    # on the GPU machine: the checkpoint, then the pipeline on it (gpu_recipe.py), then the summary
    python benchmarks/target_shape.py engine --shape qwen3-8b --tokenizer TOKDIR --save-target /tmp/qwen3-8b \
        --params params/qwen3-8b.yaml --out engine.json
    python benchmarks/gpu_recipe.py run --params params/qwen3-8b.yaml --data .carry/recipe-qwen3 \
        --target-dir /tmp/qwen3-8b --work WORK --set train.devices=1 ...
    python benchmarks/target_shape.py summary --engine engine.json --work WORK --out shape.json
    # CPU: --smoke (a tiny model of the same architecture and vocabulary, the decoder's reference ops)

`engine`, each part written to --out as it ends:
  checkpoint  the shape's random model made on the device in bf16 (transformers' init: finite through
              every layer, checked on a forward), saved with TOKDIR's tokenizer files (bench.save_target_dir)
  floor       bytes an AR step reads (every weight but the input embedding, and the KV cache of
              --context rows) ÷ a device-to-device copy's bandwidth measured here, both recorded
  verify      a verify of T rows (--rows) against the AR step, on the lean decoder where T fits its
              row limit at run time (engine.verify_shape.MAX_TREE_ROWS), and on transformers' static cache as
              CUDA graphs for every T (bench.verify_costs)
  rounds      the engine's own rounds on random prompts, a random draft of the preset's shape, K = B - 1:
              ar; domino's chain (draft block, head rollout, verify); dominotree of 16 and 64 nodes (the
              tree's build on the kernels), and of 16 built with torch ops: device ms by phase and wall
              ms a round (GenerationStats)
  round_kernels  the rounds of --kernel-modes again, on static caches launched eagerly under torch.profiler:
              each kernel's device ms and launches a round (a prefill's profile subtracted)
  train       the train stage's loop (bench.train_steps) at the preset's batch, doubled until it no longer fits
  generate    transformers' compiled static-cache `generate`: ms a step, from two lengths
`profile`: where one step's device time goes, on the lean decoder at --context cached rows: the
kernels of an AR step and of a verify of --rows rows, eager under torch.profiler (the kernels a graph
replays, timed one by one), grouped as the projections' GEMMs (with the bandwidth they reach on the
weights they read), attention, norms and rotary, the MLP's activation, and the rest; the graph's own
wall time per step beside it, and the copy bandwidth of the floor.
`summary`: the engine JSON and gpu_recipe's records (stage times, peak memory, throughput) -> one JSON,
the done-when checks, and the tables last. The projection: speed-up = τ · t_AR ÷ t_round.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from common.cli import new_draft
from common.random_models import as_target, building, random_model, save_target_dir, shape_config
from common.record import environment, write_json
from common.timing import copy_bandwidth, log, sync, verify_costs
from common.train_loop import train_steps

SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)  # the architecture and vocabulary kept, the sizes cut
TAUS = (3, 5, 7.33, 8.09)  # Domino's reruns on Qwen3-8B: 7.33; DominoTree: 8.09
ROUNDS = {"ar": ("ar", {}, {}), "domino chain": ("domino", {}, {}), "dominotree 16": ("dominotree", {"nodes": 16}, {}),
          "dominotree 64": ("dominotree", {"nodes": 64}, {}),
          "dominotree 16, torch-op build": ("dominotree", {"nodes": 16}, {"head_kernel": "torch"})}
# name -> (mode, engine.tree changes, other engine changes)


def checkpoint(args: argparse.Namespace, cuda: bool, out: dict) -> Any:
    """The random target made, checked and saved -> a dominospec Target of it (kept in memory)."""
    from transformers import AutoTokenizer

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config = shape_config(args.shape, **(SMOKE if args.smoke else {}))
    tick = time.perf_counter()
    model = random_model(config, dtype, device)
    sync(cuda)
    built = time.perf_counter()
    if "checkpoint" not in args.skip.split(","):  # skipped: the model only, in memory
        save_target_dir(args.save_target, model, args.tokenizer)
    saved = time.perf_counter()
    with torch.inference_mode():
        ids = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
        o = model(input_ids=ids, output_hidden_states=True)
        rms = [float(h.float().pow(2).mean().sqrt()) for h in o.hidden_states]  # [layers + 1] residual stream
    out["checkpoint"] = dict(shape=args.shape, config=config.to_dict(), dtype=str(dtype), dir=str(args.save_target),
                             build_s=round(built - tick, 1), save_s=round(saved - built, 1),
                             total_s=round(saved - tick, 1), finite=bool(torch.isfinite(o.logits).all()) and
                             all(r == r and r < float("inf") for r in rms), residual_rms_by_layer=[round(r, 3) for r in rms],
                             logits_std=float(o.logits.float().std()),
                             parameters=sum(p.numel() for p in model.parameters()))
    log(f"checkpoint: built {built - tick:.1f} s, saved {saved - built:.1f} s, finite {out['checkpoint']['finite']}, "
        f"residual rms {rms[1]:.2f} .. {rms[-1]:.2f}")
    return as_target(model, AutoTokenizer.from_pretrained(args.tokenizer), name=f"random-{args.shape}")


def floor(target: Any, context: int, cuda: bool, out: dict) -> None:
    """The bytes an AR step must read, the copy bandwidth, and their ratio."""
    model, config = target.model, target.model.config
    embed = target.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * context * embed.element_size()
    gbs = copy_bandwidth(cuda, gib=4.0 if cuda else 0.25)
    out["floor"] = dict(step_bytes=weights + kv, weight_bytes=weights, kv_bytes=kv, context=context,
                        copy_gb_per_s=round(gbs, 1), floor_ms=(weights + kv) / (gbs * 1e9) * 1e3)
    log(f"floor: {(weights + kv) / 1e9:.2f} GB a step at {gbs:.0f} GB/s -> {out['floor']['floor_ms']:.3f} ms")


def verify(target: Any, args: argparse.Namespace, cuda: bool, out: dict) -> None:
    """Verify of T rows on each runner that takes T -> out["verify"][runner][T]."""
    from dominospec.engine.verify_shape import MAX_TREE_ROWS
    from dominospec.engine.target_kv import LeanForward
    from dominospec.engine.runners import lean_decoder
    from dominospec.engine.target_kv import HFForward, StaticTargetKV

    rows = [int(r) for r in args.rows.split(",")]
    lean_rows = [T for T in rows if T <= MAX_TREE_ROWS]
    capacity, V = args.context + max(rows) + 8, target.identity.vocab_size
    out["verify"] = dict(lean_row_limit=MAX_TREE_ROWS, context=args.context, runners={})
    runners = {"lean": (lean_rows, lambda: StaticTargetKV(LeanForward(lean_decoder(target, triton=cuda)), [], capacity,
                                                          max(lean_rows), graphs=cuda)),
               "hf static": (rows, lambda: StaticTargetKV(HFForward(target.model), [], capacity, max(rows), graphs=cuda))}
    with torch.inference_mode():
        for name, (its_rows, make) in runners.items():
            runner = make()
            out["verify"]["runners"][name] = verify_costs(runner, V, args.context, its_rows, args.reps, cuda)
            del runner
            gc.collect()
            log(f"verify {name}: " + ", ".join(f"T={T} {v['wall_ms']:.3f}" for T, v in out["verify"]["runners"][name].items()))


def rounds(target: Any, args: argparse.Namespace, cuda: bool, out: dict) -> None:
    """The engine's rounds by mode on random prompts (a random draft: τ ≈ 1, costs only) -> out["rounds"]."""
    from dominospec.config import load_params
    from dominospec.engine import SpecEngine
    from dominospec.engine.verify_shape import MAX_TREE_ROWS
    from dominospec.eval.report import pooled

    params = load_params(args.params)
    with building(target.device, target.embed_tokens.weight.dtype):
        draft = new_draft(params, target).eval().requires_grad_(False)  # the preset's draft shape, random
    base = dataclasses.replace(params.engine, linear="torch", ngram_assist=False, ngram_fork=False,
                               cuda_graphs="on" if cuda else "static").with_tree(shape="chain")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, target.identity.vocab_size, (args.context,), generator=g).tolist() for _ in range(args.prompts)]
    out["rounds"] = dict(prompts=args.prompts, prompt_tokens=args.context, new_tokens=args.new_tokens,
                         block_size=draft.config.block_size, draft_layers=len(draft.layers),
                         candidate_pool=base.candidate_pool, tree_children=base.tree.children, modes={})
    for name, (mode, tree, extra) in ROUNDS.items():
        rows = 1 + tree.get("nodes", draft.config.block_size - 1 if mode != "ar" else 0)
        options = dataclasses.replace(base, lean_target="on" if rows <= MAX_TREE_ROWS else "off",
                                      **extra).with_tree(**tree)
        engine = SpecEngine(target, None if mode == "ar" else draft, mode, None, options)
        engine.generate(prompts[0], args.new_tokens)  # captures, allocations, kernels: the timed shapes
        p = pooled([engine.generate(prompt, args.new_tokens) for prompt in prompts])
        out["rounds"]["modes"][name] = dict(runner="lean" if engine.runners.lean is not None else "hf static", verify_rows=rows,
                                            **{k: p[k] for k in ("rounds", "draft_ms_per_round", "rollout_ms_per_round",
                                                                 "verify_ms_per_round", "wall_ms_per_round",
                                                                 "host_ms_per_round")})
        del engine
        gc.collect()
        m = out["rounds"]["modes"][name]
        log(f"rounds {name} ({m['runner']}): draft {m['draft_ms_per_round']:.3f} / rollout {m['rollout_ms_per_round']:.3f} "
            f"/ verify {m['verify_ms_per_round']:.3f} device ms, wall {m['wall_ms_per_round']:.3f} ms a round")


def round_kernels(target: Any, args: argparse.Namespace, cuda: bool, out: dict) -> None:
    """Where a round's device time goes, kernel by kernel: the rounds of --kernel-modes on static caches
    launched eagerly (the kernels a round's graphs replay, timed one by one under torch.profiler; the
    prefill's kernels subtracted) -> out["round_kernels"][mode]: device ms a round by kernel, launches a round."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from dominospec.config import load_params
    from dominospec.engine import SpecEngine
    from dominospec.engine.verify_shape import MAX_TREE_ROWS

    params = load_params(args.params)
    with building(target.device, target.embed_tokens.weight.dtype):
        draft = new_draft(params, target).eval().requires_grad_(False)
    base = dataclasses.replace(params.engine, linear="torch", ngram_assist=False, ngram_fork=False,
                               cuda_graphs="static").with_tree(shape="chain")
    prompt = torch.randint(0, target.identity.vocab_size, (args.context,), generator=torch.Generator().manual_seed(3)).tolist()
    out["round_kernels"] = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name in args.kernel_modes.split(","):
        mode, tree, extra = ROUNDS[name]
        rows = 1 + tree.get("nodes", draft.config.block_size - 1 if mode != "ar" else 0)
        options = dataclasses.replace(base, lean_target="on" if rows <= MAX_TREE_ROWS else "off", **extra).with_tree(**tree)
        engine = SpecEngine(target, None if mode == "ar" else draft, mode, None, options)
        engine.generate(prompt, args.new_tokens)  # kernels compiled, buffers allocated
        engine.generate(prompt[: args.context // 2], 4)
        with torch_profile(activities=activities) as prefill:
            engine.generate(prompt, 1)
            sync(cuda)
        with torch_profile(activities=activities) as prof:
            g = engine.generate(prompt, args.new_tokens)
            sync(cuda)
        table = kernel_table(prof, max(1, g.stats.rounds), cuda, top=args.kernel_top, minus=prefill)
        out["round_kernels"][name] = dict(rounds=g.stats.rounds, **table)
        del engine
        gc.collect()
        log(f"round kernels {name}: {table['device_ms']:.3f} device ms, {table['launches']:.0f} launches a round "
            f"over {g.stats.rounds} rounds (a prefill's kernels subtracted)")
        for k in table["top"]:
            log(f"    {k['ms']:8.4f} ms  x{k['count']:6.1f}  {k['kernel']}")


def train_batch(target: Any, args: argparse.Namespace, cuda: bool, out: dict) -> None:
    """The train stage's loop at the preset's batch, doubled until it does not fit -> out["train"]."""
    from common.cli import params_with

    base = params_with(args.params, ["train.devices=1", "train.strategy=auto"])
    batch, out["train"] = base.train.batch_size, dict(preset_batch=base.train.batch_size, steps=args.train_steps, rows=[])
    while batch <= args.max_batch:
        params = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_size=batch))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            r = train_steps(params, target, args.train_steps, 1)
            r.pop("module")
            out["train"]["rows"].append(dict(batch=batch, fits=True, **r))
        except torch.OutOfMemoryError:
            out["train"]["rows"].append(dict(batch=batch, fits=False))
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
        log(f"train: batch {batch}: {out['train']['rows'][-1]}")
        if not out["train"]["rows"][-1]["fits"]:
            break
        batch *= 2
    fitting = [r["batch"] for r in out["train"]["rows"] if r["fits"]]
    out["train"]["largest_batch"] = max(fitting) if fitting else None


def generate(target: Any, args: argparse.Namespace, cuda: bool, out: dict) -> None:
    """transformers' compiled static-cache generate: ms a step from two generation lengths -> out["generate"]."""
    from common.generate import StaticGenerate

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, target.identity.vocab_size, (args.context,), generator=g).tolist()
    short, long = 16, 16 + args.new_tokens
    hf = StaticGenerate(target, [target.identity.vocab_size - 1], prompt, long)  # a stop id the tokenizer never makes

    def timed(n: int) -> tuple[float, int]:
        sync(cuda)
        tick = time.perf_counter()
        made = len(hf(prompt, n))
        sync(cuda)
        return time.perf_counter() - tick, made

    times = [(timed(short), timed(long)) for _ in range(3)]
    per_step = sorted((b[0] - a[0]) / (b[1] - a[1]) * 1e3 for a, b in times)
    out["generate"] = dict(compiled=hf.compiled, warmup_s=round(hf.warmup_s, 1), step_ms=per_step[1], step_ms_all=per_step)
    log(f"generate: compiled {hf.compiled}, {per_step[1]:.3f} ms a step (warm-up {hf.warmup_s:.0f} s)")


def engine(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.rows, args.reps, args.context, args.prompts, args.new_tokens = "1,8,16,32,64", 2, 48, 1, 8
        args.train_steps, args.max_batch = 3, 2
    out: dict[str, Any] = dict(**environment(cuda), smoke=args.smoke, label="random weights: costs only, τ meaningless")
    target = checkpoint(args, cuda, out)
    write_json(args.out, out)
    parts: list[tuple[str, Callable]] = [("floor", floor), ("verify", verify), ("rounds", rounds), ("round_kernels", round_kernels),
                                         ("generate", generate),
                                         ("train", train_batch)]
    for name, fn in parts:
        if name in args.skip.split(","):
            continue
        try:
            fn(target, args.context, cuda, out) if name == "floor" else fn(target, args, cuda, out)
        except Exception:  # record and go on: the other parts are still worth having
            out[f"{name}_error"] = traceback.format_exc()
            log(f"{name} FAILED:\n{out[f'{name}_error']}")
        write_json(args.out, out)


KERNEL_GROUPS = (("attention", ("tree_attention",)), ("norm + rotary", ("rms_norm", "rope_cache")),
                 ("activation", ("silu_mul",)), ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "matmul", "mm_")))


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def profile(args: argparse.Namespace) -> None:
    """The `profile` part (module docstring) -> --out."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from dominospec.engine.target_kv import LeanForward, StaticTargetKV
    from dominospec.models.lean import DecoderOps, LeanDecoder

    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = random_model(shape_config(args.shape, **(SMOKE if args.smoke else {})), dtype, device)
    rows, reps = [1, int(args.rows)], 3 if args.smoke else args.reps
    out: dict[str, Any] = dict(**environment(cuda), smoke=args.smoke, context=args.context, steps={})
    linear = sum(m.weight.numel() * m.weight.element_size() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear))  # every projection and the LM head: what the GEMMs read
    out["gemm_weight_bytes"] = linear
    out["copy_gb_per_s"] = round(copy_bandwidth(cuda, gib=4.0 if cuda else 0.25), 1)
    decoder = LeanDecoder(model, DecoderOps.on(cuda))
    V = model.config.vocab_size
    with torch.inference_mode():
        for T in rows:
            for graphs in (False, True):
                runner = StaticTargetKV(LeanForward(decoder), [], args.context + T + 8, T, graphs=graphs and cuda)
                prefix = torch.randint(V, (1, args.context), device=device)
                ids = torch.randint(V, (1, T), device=device)
                runner.forward(prefix, keep=1)

                def step() -> None:
                    runner.forward(ids, keep=T)
                    runner.crop(args.context)

                for _ in range(3):
                    step()
                sync(cuda)
                if graphs:
                    tick = time.perf_counter()
                    for _ in range(reps):
                        step()
                    sync(cuda)
                    out["steps"].setdefault(T, {})["graph_wall_ms"] = 1e3 * (time.perf_counter() - tick) / reps
                    continue
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with torch_profile(activities=activities) as prof:
                    for _ in range(reps):
                        step()
                    sync(cuda)
                out["steps"].setdefault(T, {})["kernels"] = kernel_table(prof, reps, cuda)
                del runner
    for T, step_out in out["steps"].items():
        groups = step_out["kernels"]["groups_ms"]
        gemm = groups.get("gemm", 0.0)
        step_out["gemm_gb_per_s"] = linear / (gemm * 1e6) if gemm else None
        log(f"profile T={T}: graph {step_out.get('graph_wall_ms', float('nan')):.3f} ms a step; device "
            + ", ".join(f"{g} {ms:.3f}" for g, ms in groups.items())
            + (f"; GEMMs at {step_out['gemm_gb_per_s']:.0f} GB/s of {out['copy_gb_per_s']:.0f}" if gemm else ""))
    write_json(args.out, out)


def device_kernels(prof: Any, cuda: bool) -> dict[str, tuple[float, float]]:
    """A finished torch.profiler run -> kernel name: (device ms, launches) in all."""
    kernels = {}
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(evt, "self_cuda_time_total", 0.0)
        if cuda and device_us > 0 and evt.device_type is not None and "CUDA" in str(evt.device_type):
            kernels[evt.key] = (device_us / 1e3, float(evt.count))
    return kernels


def kernel_table(prof: Any, reps: int, cuda: bool, top: int = 12, minus: Any = None) -> dict:
    """A profile of `reps` steps (less the profile `minus`, kernel by kernel: the prefill of a round's
    profile) -> device ms a step by kernel group, the top kernels, launches a step."""
    less = device_kernels(minus, cuda) if minus is not None else {}
    kernels = []
    for name, (ms, count) in device_kernels(prof, cuda).items():
        ms0, count0 = less.get(name, (0.0, 0.0))
        if count > count0:
            kernels.append((name, (ms - ms0) / reps, (count - count0) / reps))
    groups: dict[str, float] = {}
    for name, ms, _ in kernels:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + ms
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return dict(groups_ms={g: round(ms, 4) for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
                device_ms=round(sum(ms for _, ms, _ in kernels), 4), launches=round(sum(c for *_, c in kernels), 1),
                top=[dict(kernel=name[:90], ms=round(ms, 4), count=round(c, 1)) for name, ms, c in ranked])


def stages(work: Path) -> dict:
    """gpu_recipe's records under `work` -> per stage: seconds, peak GPU GiB, throughput; what evaluate did."""
    import yaml

    metrics = work / "metrics"
    params = yaml.safe_load((work / "recipe-params.yaml").read_text())
    per: dict[str, dict] = {}
    for t in json.loads((metrics / "recipe_times.json").read_text()):
        s = per.setdefault(t["stage"], dict(seconds=0.0, peak_reserved_gib=0.0, peak_allocated_gib=0.0, done=True))
        s["seconds"] += t["seconds"] or 0.0
        s["done"] = s["done"] and t["seconds"] is not None
        for k in ("peak_reserved_gib", "peak_allocated_gib"):
            s[k] = max(s[k], t.get(k) or 0.0)
    read = {n: json.loads((metrics / f"{n}.json").read_text()) for n in ("regenerate", "train", "eval")
            if (metrics / f"{n}.json").exists()}
    if "regenerate" in read:
        r = read["regenerate"]
        per["regenerate"].update(tokens_per_s=r["tokens_per_second"], tokens=r["tokens_generated"],
                                 replies=r["assistant_turns_regenerated"], batch=r["batch_size"],
                                 max_new_tokens=r["max_new_tokens"])
    if "train" in read:
        t, batch, anchors = read["train"], params["train"]["batch_size"], params["train"]["num_anchors"]
        per["train"].update(steps=t["steps"], batch=batch, blocks_per_s=t["steps"] * batch * anchors / (60 * t["train_minutes"]),
                            train_minutes=t["train_minutes"])
    if "eval" in read:  # τ left out on purpose: random weights
        per["evaluate"].update(suites={k: dict(prompts=v["n_prompts"], exact_match=v["exact_match"])
                                       for k, v in read["eval"]["suites"].items()})
    return per


def checks(e: dict) -> tuple[dict, list[dict]]:
    """The engine JSON -> (the issue's targets, each with its value and whether it is met; projection rows)."""
    lean = e["verify"]["runners"].get("lean", {})
    ar = lean["1"]["wall_ms"]
    modes = e["rounds"]["modes"]
    device_ar = modes["ar"]["verify_ms_per_round"]
    draft, head, tree16 = (modes["domino chain"]["draft_ms_per_round"], modes["domino chain"]["rollout_ms_per_round"],
                           modes["dominotree 16"]["rollout_ms_per_round"])
    rows = []
    for name in ("domino chain", "dominotree 16", "dominotree 64"):
        m = modes[name]
        rows.append(dict(config=f"{name}: round wall ({m['runner']} verify of {m['verify_rows']} rows)",
                         t_ar=modes["ar"]["wall_ms_per_round"], t_round=m["wall_ms_per_round"]))
        rows.append(dict(config=f"{name}: device draft + {'head' if 'chain' in name else 'tree build'} + verify",
                         t_ar=device_ar, t_round=m["draft_ms_per_round"] + m["rollout_ms_per_round"] + m["verify_ms_per_round"]))
    for r in rows:
        r["speedup"] = {str(tau): tau * r["t_ar"] / r["t_round"] for tau in TAUS}
    best = max(r["speedup"]["7.33"] for r in rows[:2])  # Domino's τ 7.33 belongs to its chain
    targets = {
        "lean AR step <= 1.15 x floor": dict(value=ar / e["floor"]["floor_ms"], limit=1.15),
        "lean AR step <= transformers' compiled step": dict(value=ar / e["generate"]["step_ms"], limit=1.0)
        if "generate" in e else dict(value=None, limit=1.0),
        "verify of 64 rows <= 1.15 AR steps": dict(value=lean["64"]["wall_ms"] / ar, limit=1.15),
        "draft + head + 16-node tree build <= 0.30 AR steps (device)": dict(value=(draft + head + tree16) / device_ar,
                                                                           limit=0.30),
        "projected speed-up at τ 7.33 >= 5.5 (domino chain)": dict(value=best, limit=5.5, at_least=True),
    }
    for t in targets.values():
        t["met"] = None if t["value"] is None else (t["value"] >= t["limit"] if t.get("at_least") else t["value"] <= t["limit"])
    return targets, rows


def summary(args: argparse.Namespace) -> None:
    e = json.loads(Path(args.engine).read_text())
    out = dict(environment=environment(), engine=e, stages=stages(Path(args.work)) if args.work else None)
    write_json(args.out, out)
    out["targets"], out["projection"] = checks(e)
    write_json(args.out, out)
    lean, hf = e["verify"]["runners"].get("lean", {}), e["verify"]["runners"].get("hf static", {})
    ar = lean["1"]["wall_ms"]
    lines = [f"\n{e['device']}, torch {e['torch']}, transformers {e['transformers']}, triton {e['triton']}, {e['date']}; "
             f"{e['checkpoint']['shape']} random weights (τ meaningless); JSON {args.out}", ""]
    if out["stages"]:
        lines += ["| stage | seconds | peak GPU GiB (reserved / allocated) | throughput |", "|---|---|---|---|"]
        for name, s in out["stages"].items():
            tp = (f"{s['tokens_per_s']:.0f} tokens/s ({s['replies']} replies, batch {s['batch']})" if "tokens_per_s" in s else
                  f"{s['blocks_per_s']:.0f} blocks/s at batch {s['batch']} ({s['steps']} steps)" if "blocks_per_s" in s else "")
            lines.append(f"| {name}{'' if s['done'] else ' (NOT finished)'} | {s['seconds']:.0f} | "
                         f"{s['peak_reserved_gib']:.1f} / {s['peak_allocated_gib']:.1f} | {tp} |")
    c, f = e["checkpoint"], e["floor"]
    lines += ["", f"checkpoint: built {c['build_s']} s + saved {c['save_s']} s, finite {c['finite']}; floor: "
              f"{f['step_bytes'] / 1e9:.2f} GB a step / {f['copy_gb_per_s']:.0f} GB/s copy = {f['floor_ms']:.3f} ms; "
              f"lean AR {ar:.3f} ms; transformers compiled generate {e.get('generate', {}).get('step_ms', float('nan')):.3f} ms a step",
              "", "| rows | " + " | ".join(hf) + " |", "|---|" + "---|" * len(hf)]
    for name, by in (("lean", lean), ("hf static", hf)):
        lines.append(f"| {name}: ms (÷ lean AR) | " + " | ".join(
            f"{by[T]['wall_ms']:.3f} ({by[T]['wall_ms'] / ar:.2f})" if T in by else "–" for T in hf) + " |")
    lines += ["", "| mode | runner | draft | head / tree build | verify | device ms ÷ AR | wall ms a round |", "|---|---|---|---|---|---|---|"]
    device_ar = e["rounds"]["modes"]["ar"]["verify_ms_per_round"]
    for name, m in e["rounds"]["modes"].items():
        parts = (m["draft_ms_per_round"], m["rollout_ms_per_round"], m["verify_ms_per_round"])
        lines.append(f"| {name} | {m['runner']} | " + " | ".join(f"{x:.3f}" for x in parts) +
                     f" | {sum(parts) / device_ar:.2f} | {m['wall_ms_per_round']:.3f} |")
    if "train" in e:
        lines += ["", "train loop (bench.train_steps): " + "; ".join(
            f"batch {r['batch']}: " + (f"{r['blocks_per_s']:.0f} blocks/s, {r['peak_gib']:.1f} GiB" if r["fits"] else "out of memory")
            for r in e["train"]["rows"]) + f"; largest batch that fits {e['train'].get('largest_batch')}"]
    lines += ["", "PROJECTION (measured costs, τ given; not a measured speed-up)", "",
              "| configuration | t_AR ms | t_round ms | " + " | ".join(f"× at τ {t}" for t in TAUS) + " |",
              "|---|---|---|" + "---|" * len(TAUS)]
    for r in out["projection"]:
        lines.append(f"| {r['config']} | {r['t_ar']:.3f} | {r['t_round']:.3f} | "
                     + " | ".join(f"{v:.2f}" for v in r["speedup"].values()) + " |")
    lines += ["", "| target | value | met |", "|---|---|---|"]
    for name, t in out["targets"].items():
        value = "–" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"| {name} | {value} (limit {t['limit']}) | {t['met']} |")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("engine")
    p.add_argument("--shape", default="qwen3-8b", help="bench.TARGET_SHAPES")
    p.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json and tokenizer_config.json")
    p.add_argument("--save-target", required=True, help="where the HF checkpoint is written")
    p.add_argument("--params", default="params/qwen3-8b.yaml", help="the preset: its draft, engine and train")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny model of the shape's architecture")
    p.add_argument("--context", type=int, default=1024, help="cached rows before a step; the prompts' length")
    p.add_argument("--rows", default="1,8,16,32,64,128,256")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--train-steps", type=int, default=4, help="per batch (the first untimed)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kernel-modes", default="ar,domino chain,dominotree 16", help="round_kernels: modes profiled")
    p.add_argument("--kernel-top", type=int, default=25, help="round_kernels: kernels listed a mode")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out (checkpoint: made, not saved)")
    r = sub.add_parser("profile")
    r.add_argument("--shape", default="qwen3-8b", help="bench.TARGET_SHAPES")
    r.add_argument("--context", type=int, default=1024)
    r.add_argument("--rows", default="64", help="the verify's rows beside the AR step")
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--smoke", action="store_true")
    r.add_argument("--out", required=True)
    q = sub.add_parser("summary")
    q.add_argument("--engine", required=True)
    q.add_argument("--work", help="gpu_recipe.py run's --work")
    q.add_argument("--out", required=True)
    args = ap.parse_args()
    {"engine": engine, "profile": profile, "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    main()
