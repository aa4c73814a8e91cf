"""The regenerate stage's decoder on its own: decode steps a second of `ReplyStream` over `SlotKV`.

A target of SmolLM2-135M-Instruct's shapes with random weights (the values change nothing of the
cost), S slots of random prompts (40..600 tokens, as ShareGPT first turns), every reply decoded to
its full budget (no stop token: the worst case, and the stage's most common one: 64 % of the
preset's replies hit the cap). Reports the prefill time, decode steps/s and tokens/s (the
decode time includes freeing the finished slots, as the stage does, so the last step pays the
caches' compaction), and with `--profile` the ops of a packed prefill and of 4 decode steps on a
quarter of the slots, under torch.profiler.

    python benchmarks/studies/decode_steps.py [--slots 1024] [--new-tokens 64] [--dtype float32] [--group N] [--profile]
"""

from __future__ import annotations

import sys
from pathlib import Path

import json
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import parser  # noqa: E402
from common.random_models import SMOLLM2_135M, random_model  # noqa: E402
from common.record import device_name  # noqa: E402
from common.timing import sync  # noqa: E402


def main() -> None:
    from transformers import LlamaConfig

    from dominospec.regenerate.decoder import DecodePolicy, ReplyStream
    from dominospec.regenerate.kv_batch import SlotKV, grouped_attention_on

    p = parser(__doc__, params=None, new_tokens=64)
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--group", type=int, default=None, help="slots per KV group (default: kv_batch's for the device)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = LlamaConfig(**SMOLLM2_135M)
    model = random_model(config, getattr(torch, args.dtype), device)
    g = torch.Generator().manual_seed(0)
    prompts = sorted((torch.randint(0, 49152, (int(torch.randint(40, 600, (1,), generator=g)),), generator=g).tolist()
                      for _ in range(args.slots)), key=len)  # the stage sorts a chunk by prompt length
    kv = SlotKV(config.num_hidden_layers, args.slots, capacity=64, limit=1025, group_slots=args.group, device=device)
    stream = ReplyStream(model, kv, DecodePolicy(stop_ids=()))

    def profiled(label: str, steps: int) -> None:
        """`steps` calls of `stream.step()` (the stream of the moment) under torch.profiler -> its top ops, printed."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                for key, _ in stream.step():
                    stream.end(key)
            sync(cuda)
        print(f"== {label}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))

    with grouped_attention_on(model, kv):
        for i, ids in enumerate(prompts):
            stream.start(i, ids, args.new_tokens)
        tick = time.perf_counter()
        stream.step()  # the packed prefill of every slot, then the first decode step
        sync(cuda)
        prefill = time.perf_counter() - tick
        steps, tick = 0, time.perf_counter()
        while stream.running:
            for key, _ in stream.step():
                stream.end(key)  # as the stage does: a finished conversation frees its slot
            steps += 1
        sync(cuda)
        decode = time.perf_counter() - tick
    row = {"device": device_name(cuda) if cuda else "cpu", "slots": args.slots, "group": kv.group_slots,
           "dtype": args.dtype, "prefill_s": round(prefill, 2), "decode_steps": steps, "decode_s": round(decode, 2),
           "ms_per_step": round(1e3 * decode / max(1, steps), 2), "tokens_per_s": round(args.slots * steps / decode)}
    print(json.dumps(row))
    if args.profile:  # again, a quarter of the slots in a fresh cache: the prefill, then 4 decode steps
        kv = SlotKV(config.num_hidden_layers, args.slots // 4, capacity=64, limit=1025, group_slots=args.group,
                    device=device)
        stream = ReplyStream(model, kv, DecodePolicy(stop_ids=()))
        with grouped_attention_on(model, kv):
            for i, ids in enumerate(prompts[: args.slots // 4]):
                stream.start(i, ids, 6)
            profiled(f"packed prefill of {args.slots // 4} prompts (+ one decode step)", 1)
            profiled("4 decode steps", 4)


if __name__ == "__main__":
    main()
