"""What the target's attention costs on CPU: transformers' `sdpa` against `grouped_sdpa` (runtime.attention).

Three measurements in one process, the two attentions interleaved in each so that machine load
hits them alike:

    layer   one attention call, SmolLM2's heads (9 query on 3 key/value heads, d = 64): repeat_kv + SDPA
            (what `sdpa` does for several rows with a mask) against SDPA with enable_gqa; µs, median
    forward the packed fp32 target's forward of T rows on a cached context of S rows, with the tree
            mask of a verify (T > 1); ms, fastest of --reps
    rounds  AR and Domino (params engine:, auto-K, the trained draft) on the first --prompts prompts
            of a suite: the drafted round in AR steps and the decode speed-up, per attention

    python benchmarks/studies/attention_cpu.py [--params params.yaml] [--draft artifacts/draft] [--suite humaneval]
        [--prompts 6] [--new-tokens 128] [--threads 2] [--reps 8] [--skip-rounds]

Prints a markdown table per measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_draft, load_target, parser, setup, suites  # noqa: E402

CONTEXTS = (150, 300, 600)
ROWS = (1, 5, 12)
ATTENTIONS = ("sdpa", "dominospec_grouped_sdpa")


def layer_us(S: int, T: int, repeats: int = 300) -> dict[str, float]:
    """One attention call of SmolLM2's shapes over S columns, T rows -> {path: median µs}."""
    from transformers.integrations.sdpa_attention import repeat_kv

    g = torch.Generator().manual_seed(S + T)
    q, k, v = torch.randn(1, 9, T, 64, generator=g), torch.randn(1, 3, S, 64, generator=g), torch.randn(1, 3, S, 64, generator=g)
    mask = torch.ones(1, 1, T, S, dtype=torch.bool)
    mask[..., S - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    paths = {
        "repeat_kv": lambda: F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask),
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
    }
    times = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e6 * (time.perf_counter() - t0))
    return {name: statistics.median(ts) for name, ts in times.items()}


def forward_ms(target, S: int, T: int, reps: int) -> dict[str, float]:
    """The target's forward of T rows (a 3-branch tree when T > 1) after S cached rows -> {attention: fastest ms}."""
    from dominospec.engine.verify_shape import branch_tree
    from dominospec.engine.target_kv import DynamicTargetKV

    ids = torch.randint(100, 40000, (1, S), generator=torch.Generator().manual_seed(S))
    lengths = [n for n in ((T - 1 + i) // 3 for i in range(3)) if n]  # T - 1 drafts over up to 3 branches
    tree = branch_tree(lengths, torch.device("cpu")) if lengths else None
    kv = DynamicTargetKV(target.model, [1, 8, 14, 20, 27])
    times = {name: [] for name in ATTENTIONS}
    with torch.inference_mode():
        kv.forward(ids, keep=1)
        for _ in range(reps):
            for name in ATTENTIONS:
                target.model.set_attn_implementation(name)
                t0 = time.perf_counter()
                kv.forward(ids[:, :T], keep=T, tree=tree)
                times[name].append(1000 * (time.perf_counter() - t0))
                kv.crop(S)
    target.model.set_attn_implementation(ATTENTIONS[1])
    return {name: min(ts) for name, ts in times.items()}


def rounds(target, params, draft_path: str, suite: str, prompts: int, new_tokens: int) -> dict[str, dict[str, float]]:
    """AR and Domino per attention, interleaved prompt by prompt -> {attention: round / AR step, τ, decode speed-up}."""
    from dominospec.engine import SpecEngine

    loaded = next(suites(params, target.tokenizer, prompts, [suite]))
    draft = load_draft(params, target, draft_path)
    options = dataclasses.replace(params.engine, linear="packed")
    engines = {name: (SpecEngine(target, None, "ar", None, options), SpecEngine(target, draft, "domino", "auto", options))
               for name in ATTENTIONS}
    sums = {name: dict.fromkeys(("ar_s", "ar_steps", "ar_decode_s", "ar_tokens", "round_s", "rounds", "drafted",
                                 "tokens", "round_tokens", "decode_s"), 0.0) for name in ATTENTIONS}
    for prompt in loaded.prompts:
        for name, (ar, spec) in engines.items():
            target.model.set_attn_implementation(name)
            a = ar.generate(prompt, new_tokens).stats
            s = spec.generate(prompt, new_tokens).stats
            acc = sums[name]
            acc["ar_s"] += a.verify_s
            acc["ar_steps"] += a.rounds
            acc["ar_decode_s"] += a.total_s - a.prefill_s
            acc["ar_tokens"] += a.new_tokens
            acc["round_s"] += s.draft_round_s
            acc["drafted"] += s.draft_rounds
            acc["rounds"] += s.rounds
            acc["round_tokens"] += s.round_tokens
            acc["tokens"] += s.new_tokens
            acc["decode_s"] += s.total_s - s.prefill_s
    target.model.set_attn_implementation(ATTENTIONS[1])
    out = {}
    for name, acc in sums.items():
        ar_step = acc["ar_s"] / acc["ar_steps"]
        out[name] = {"round_over_ar_step": acc["round_s"] / acc["drafted"] / ar_step,
                     "tau": acc["round_tokens"] / acc["rounds"],
                     "decode_speedup": (acc["tokens"] / acc["decode_s"]) / (acc["ar_tokens"] / acc["ar_decode_s"])}
    return out


def main() -> None:
    from dominospec.runtime.attention import use_grouped_sdpa
    from dominospec.runtime.packed import pack_linears

    p = parser(__doc__, threads=2, prompts=6, new_tokens=128)
    p.add_argument("--draft", default="artifacts/draft")
    p.add_argument("--suite", default="humaneval")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--skip-rounds", action="store_true")
    args = p.parse_args()
    params = setup(args)

    print("| S | T | repeat_kv + SDPA µs | SDPA enable_gqa µs |\n|---|---|---|---|")
    for S in CONTEXTS:
        for T in ROWS:
            us = layer_us(S, T)
            print(f"| {S} | {T} | {us['repeat_kv']:.0f} | {us['enable_gqa']:.0f} |", flush=True)

    target = load_target(params)
    pack_linears(target.model)
    use_grouped_sdpa(target.model)
    print("\n| S | T | forward ms, sdpa | forward ms, grouped_sdpa |\n|---|---|---|---|")
    for S in CONTEXTS:
        for T in ROWS:
            ms = forward_ms(target, S, T, args.reps)
            print(f"| {S} | {T} | {ms['sdpa']:.1f} | {ms[ATTENTIONS[1]]:.1f} |", flush=True)

    if not args.skip_rounds:
        result = rounds(target, params, args.draft, args.suite, args.prompts, args.new_tokens)
        print(f"\n{args.suite}, {args.prompts} prompts x {args.new_tokens} tokens, auto-K, params engine:")
        print("| attention | τ | drafted round ÷ AR step | decode speed-up over AR |\n|---|---|---|---|")
        for name, r in result.items():
            print(f"| {name} | {r['tau']:.2f} | {r['round_over_ar_step']:.3f} | {r['decode_speedup']:.2f} |")


if __name__ == "__main__":
    main()
