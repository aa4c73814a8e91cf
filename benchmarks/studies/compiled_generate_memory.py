"""Does transformers' compiled `generate` touch memory it no longer owns? The crash beside it, bisected.

    python benchmarks/studies/compiled_generate_memory.py --gguf-dir DIR --prompts prompt_ids.jsonl \
        --out memory.json [--cache fresh|kept] [--trees on|off] [--calls 8] [--new-tokens 256]

`generate` with `cache_implementation="static"` and `CompileConfig(mode="reduce-overhead")` compiles
the decode step and replays it as CUDA graphs (torch.compile's CUDA graph trees; `--trees off`: the
older one-graph-per-shape path). The static cache's K/V tensors and its write counter
(`cumulative_length`, a 0-d tensor mutated in place by the step) are marked as static addresses, so
the recorded graphs read and write them by pointer.

`--cache fresh` is what `generate` does by itself: a new StaticCache every call, the last one freed
when the call returns. `--cache kept` passes one StaticCache, sized once and reset before each call.

Per call k (prompts of the suites alternated, `--new-tokens` each, greedy):
- the counter against the rows the call wrote (prompt + new tokens - 1): a counter ahead of them
  means the step ran its in-place add more often than it decoded, and writes past the rows it owns;
- the cache's K pointer, and whether it moved since the last call;
- canaries: right after call k returns (its cache freed under `fresh`), tensors shaped like its K/V
  are allocated (the caching allocator hands back the freed blocks: their pointers are recorded) and
  filled with a pattern; after call k + 1, any canary element changed was written by that call
  through a pointer it no longer owned.
No part of dominospec's engine runs in this process: what it finds is transformers' and torch's.
Prints a line a call, then a table last; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PATTERN = 7.0  # exactly representable in bf16


def load(args: argparse.Namespace):
    """-> (HF model on CUDA in bf16, prompts [(suite, ids)] alternated, stop ids)."""
    import dataclasses

    from dominospec.config import load_params
    from dominospec.target import load_target

    params = load_params(args.params)
    target = load_target(dataclasses.replace(params.target, model=args.gguf_dir, device="auto", dtype="bfloat16"))
    by_suite: dict[str, list[list[int]]] = {}
    for line in Path(args.prompts).read_text().splitlines():
        row = json.loads(line)
        by_suite.setdefault(row.get("suite", "all"), []).append(row["prompt_ids"])
    plan, i = [], 0
    while len(plan) < args.calls and any(i < len(p) for p in by_suite.values()):
        plan += [(s, p[i]) for s, p in by_suite.items() if i < len(p)]
        i += 1
    stops = sorted({2, target.tokenizer.eos_token_id} - {None})
    plan = plan[: args.calls - 1]
    longest = max((ids for _, p in by_suite.items() for ids in p[:i]), key=len)
    return target.model, [("longest", longest)] + plan, stops  # call 0 sizes the cache, as a warm-up does


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def layers(cache) -> list:
    """A transformers StaticCache -> its per-layer objects holding keys / values / cumulative_length."""
    return list(getattr(cache, "layers", []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--gguf-dir", required=True)
    p.add_argument("--prompts", required=True, help="JSONL of {prompt_ids, suite}")
    p.add_argument("--out", required=True)
    p.add_argument("--cache", choices=["fresh", "kept"], default="fresh")
    p.add_argument("--trees", choices=["on", "off"], default="on")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args()

    import transformers
    from transformers import CompileConfig, StaticCache

    torch._inductor.config.triton.cudagraph_trees = args.trees == "on"
    model, plan, stops = load(args)
    longest = max(len(ids) for _, ids in plan) + args.new_tokens
    kept = StaticCache(config=model.config, max_cache_len=longest) if args.cache == "kept" else None
    kwargs = dict(do_sample=False, eos_token_id=stops, pad_token_id=stops[0], max_new_tokens=args.new_tokens,
                  compile_config=CompileConfig(fullgraph=False, mode="reduce-overhead"),
                  return_dict_in_generate=True)
    result = dict(torch=torch.__version__, transformers=transformers.__version__,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", cache=args.cache, trees=args.trees, calls=[])

    def generate(ids: list[int]):
        x = torch.tensor([ids], device=model.device)
        torch.compiler.cudagraph_mark_step_begin()
        if kept is not None:
            kept.reset()
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), past_key_values=kept, **kwargs)
        else:
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), cache_implementation="static", **kwargs)
        sync()
        return out

    canaries: list[torch.Tensor] = []
    last_ptr = None
    for k, (suite, ids) in enumerate(plan):
        tick = time.perf_counter()
        out = generate(ids)
        seconds = time.perf_counter() - tick
        changed = sum(int((c != PATTERN).sum()) for c in canaries)
        new = out.sequences.shape[1] - len(ids)
        cache = out.past_key_values
        first = layers(cache)[0]
        counter, capacity = int(first.cumulative_length), int(first.max_cache_len)
        ptr = first.keys.data_ptr()
        row = dict(call=k, suite=suite, prompt_tokens=len(ids), new_tokens=new, seconds=round(seconds, 2),
                   rows_written=len(ids) + new - 1, counter=counter, capacity=capacity,
                   counter_ahead=counter - (len(ids) + new - 1), keys_ptr=ptr, keys_moved=last_ptr not in (None, ptr),
                   canary_elements=sum(c.numel() for c in canaries), canary_changed=changed)
        last_ptr = ptr
        freed = {t.data_ptr() for layer in layers(cache) for t in (layer.keys, layer.values)}
        shapes = [(t.shape, t.dtype) for layer in layers(cache) for t in (layer.keys, layer.values)]
        del out, cache, first
        canaries = []
        for shape, dtype in shapes:  # take the freed blocks back (under `kept` nothing was freed)
            canaries.append(torch.full(shape, PATTERN, dtype=dtype, device=model.device))
        row["canaries_on_freed_blocks"] = sum(c.data_ptr() in freed for c in canaries)
        sync()
        result["calls"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{result['device']}, torch {result['torch']}, transformers {result['transformers']}; "
          f"cache {args.cache}, CUDA graph trees {args.trees}\n")
    print("| call | prompt | new | counter − rows written | capacity | K moved | canaries on freed blocks | "
          "canary elements changed by the next call |\n|---|---|---|---|---|---|---|---|")
    calls = result["calls"]
    for row, after in zip(calls, calls[1:] + [None]):
        hit = "–" if after is None else f"{after['canary_changed']} of {after['canary_elements']}"
        print(f"| {row['call']} | {row['prompt_tokens']} | {row['new_tokens']} | {row['counter_ahead']} | {row['capacity']} | "
              f"{row['keys_moved']} | {row['canaries_on_freed_blocks']} | {hit} |")


if __name__ == "__main__":
    main()
