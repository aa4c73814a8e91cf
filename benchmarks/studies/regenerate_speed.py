"""Regeneration tokens/s: the stage's batched KV-cache decoder by dtype and batch size, against HF `generate`.

One process, one target; the same conversations (the first N of the prepared train split, sorted
by first-prompt length as the stage sorts them) go through every configuration, and the rounds
interleave the configurations, so all see the same machine load.

    python benchmarks/studies/regenerate_speed.py --params params.yaml [--conversations 64] \
        [--max-new-tokens 256] [--configs bfloat16:64:packed:16,bfloat16:64:torch:all] [--hf-generate 8] \
        [--rounds 1] [--threads 2]

A config is `dtype:batch[:linear[:group]]`: linear `packed` (the stage's `regenerate.linear`, the
default) or `torch`; group = slots per KV group (`kv_batch.GROUP_SLOTS`, the default) or `all` (one
buffer for the whole batch, as before the groups). Conversations are cut to `regenerate.max_turns`
as the stage cuts them.

`--hf-generate B` adds the previous implementation (HF `generate` per turn, left-padded batches
of B, every turn re-rendered and recomputed, fp32). Prints one JSON line per measurement and a
markdown table of the median tokens/s per configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import copy
import dataclasses
import json
import statistics
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_target, parser, setup  # noqa: E402


def main() -> None:
    from dominospec.data.dataset import read_dataset
    from dominospec.regenerate import kv_batch
    from dominospec.regenerate.stage import first_turns, length_sorted_chunks
    from dominospec.runtime.packed import pack_linears
    from dominospec.regenerate.replies import rewrite_conversations
    from dominospec.target import DTYPES

    p = parser(__doc__, threads=2)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--configs", default="float32:8,bfloat16:8,bfloat16:32", help="dtype:batch_size, comma-separated")
    p.add_argument("--hf-generate", type=int, default=0, help="batch size of the HF generate baseline (0: none)")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()

    params = setup(args)
    splits, meta = read_dataset(params.paths.prepared)
    target = load_target(params)
    train, max_length = splits["train"], int(meta["max_length"])
    count = min(args.conversations, len(train))
    configs = []
    for spec in args.configs.split(","):
        dtype, batch, *rest = spec.split(":")
        linear = rest[0] if rest else "packed"
        group = rest[1] if len(rest) > 1 else str(kv_batch.GROUP_SLOTS)
        configs.append((dtype, int(batch), linear, 1 << 30 if group == "all" else int(group)))
    models = {}
    for dtype, _, linear, _ in configs:
        if (dtype, linear) not in models:
            models[dtype, linear] = copy.deepcopy(target.model).to(DTYPES[dtype])
            if linear == "packed":
                pack_linears(models[dtype, linear])
    default_group = kv_batch.GROUP_SLOTS
    runs: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for dtype, batch, linear, group in configs + ([("hf_generate", args.hf_generate, "torch", 0)] if args.hf_generate else []):
            cfg = dataclasses.replace(params.regenerate, max_new_tokens=args.max_new_tokens, batch_size=batch,
                                      dtype=dtype if dtype != "hf_generate" else "float32")  # fmt: skip
            template_kwargs = params.target.chat_template_kwargs
            chunks = length_sorted_chunks(target.tokenizer, train, count, batch, template_kwargs)
            kv_batch.GROUP_SLOTS = group or default_group
            tokens, tick = 0, time.perf_counter()
            for rows in chunks:
                conversations = [first_turns(train[i]["messages"], cfg.max_turns) for i in rows]
                if dtype == "hf_generate":
                    tokens += hf_generate_rewrite(target, conversations, cfg, max_length)
                else:
                    run_target = dataclasses.replace(target, model=models[dtype, linear])
                    done = rewrite_conversations(run_target, conversations, cfg, max_length, template_kwargs,
                                                 torch.Generator().manual_seed(0))
                    tokens += sum(r.generated_tokens for r in done)
            seconds = time.perf_counter() - tick
            name = f"{dtype}:{batch}" if dtype == "hf_generate" else f"{dtype}:{batch}:{linear}:{'all' if group > 4096 else group}"
            runs.setdefault(name, []).append(tokens / seconds)
            print(json.dumps({"config": name, "round": round_, "conversations": count, "tokens": tokens,
                              "seconds": round(seconds, 1), "tokens_per_second": round(tokens / seconds, 1)}), flush=True)  # fmt: skip
    base = statistics.median(runs[f"hf_generate:{args.hf_generate}"]) if args.hf_generate else None
    print("\n| config (dtype:batch:linear:group) | tokens/s | × HF generate |\n|---|---|---|")
    for name, rates in runs.items():
        ratio = f"{statistics.median(rates) / base:.1f}×" if base else "—"
        print(f"| {name} | {statistics.median(rates):.0f} | {ratio} |")


def hf_generate_rewrite(target, conversations, cfg, max_length) -> int:
    """The previous implementation: per turn, re-render every history and HF-`generate` left-padded -> tokens."""
    from transformers import GenerationConfig

    from dominospec.data.chat import render_text
    from dominospec.stops import stop_token_ids

    tokenizer, stop_ids = target.tokenizer, stop_token_ids(target.tokenizer, target.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    histories, cursor, active, total = [[] for _ in conversations], [0] * len(conversations), list(range(len(conversations))), 0
    while active:
        prompts, budgets, still = [], [], []
        for i in active:
            source = conversations[i]
            while cursor[i] < len(source) and source[cursor[i]]["role"] != "assistant":
                histories[i].append(dict(source[cursor[i]]))
                cursor[i] += 1
            if cursor[i] == len(source):
                continue
            ids = tokenizer(render_text(tokenizer, histories[i], True, {}), add_special_tokens=False)["input_ids"]
            budget = min(cfg.max_new_tokens, max_length - len(ids))
            if budget > 0:
                prompts.append(ids), budgets.append(budget), still.append(i)
        if not still:
            break
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
        generation = GenerationConfig(max_new_tokens=max(budgets), do_sample=False, eos_token_id=stop_ids, pad_token_id=pad_id)
        with torch.inference_mode():
            out = target.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=generation)
        for row, (i, budget) in enumerate(zip(still, budgets)):
            new = out[row, width:].tolist()[:budget]
            stop = next((t for t, tok in enumerate(new) if tok in stop_ids), None)
            total += len(new) if stop is None else stop + 1
            content = new if stop is None else new[:stop]
            histories[i].append({"role": "assistant", "content": tokenizer.decode(content, skip_special_tokens=True)})
            cursor[i] += 1
        active = still
    return total


if __name__ == "__main__":
    main()
