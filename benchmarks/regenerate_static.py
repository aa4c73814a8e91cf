"""Regeneration speed: today's slot decoder (`regenerate.decoder: stream`) beside the static batched
decoder (`static`) with each decode attention (`regenerate.attention`: `padded`, every row over the
batch's longest, as before; `rows`, each row over its own columns), on the same prompts, in one
process; the table comes last.

    # CPU, a tiny budget (the embedded SmolLM2, or --tiny: a random 2-layer model on its tokenizer)
    python benchmarks/regenerate_static.py --prompts 32 --max-new-tokens 32 --slots 32
    # one GPU, no GGUF: a random model of SmolLM2-135M's shapes on random prompt ids
    python benchmarks/regenerate_static.py --random-shape --prompts 4096 --slots 1024 --max-new-tokens 256 \
        --out speed.json
    # one GPU: the prompts packed by benchmarks/gpu_recipe.py, the GGUF's folder
    python benchmarks/regenerate_static.py --conversations .carry/recipe/conversations.jsonl.xz \
        --gguf-dir DIR --prompts 4096 --slots 1024 --max-new-tokens 256 --out speed.json

With the target (the GGUF, or --tiny), each path decodes the first `--prompts` first turns greedily
(regenerate.temperature 0) with the params' dtype, loop rule and budget: `stream` through
`replies.rewrite_conversations` in chunks of `--slots` conversations, as the stage runs it (with its
CPU linear packing); `static` through `StaticDecoder` with `--slots` slots (CUDA graphs on CUDA),
its first run capturing the graphs and later runs warm (`--rounds`), once per `--attention`.

--random-shape NAME (default smollm2-135m, benchmarks/common/random_models.py) needs no weights
and no tokenizer: random weights of the named shape in the params' dtype, and `--prompts` random
prompts whose lengths follow a log-normal (median --prompt-median, default PROMPT_MEDIAN tokens as
ShareGPT's first turns; sigma PROMPT_SIGMA; within [PROMPT_MIN, max_length - max_new_tokens]) and
whose reply budgets an exponential (mean REPLY_MEAN tokens, at most max_new_tokens; the real
SmolLM2's replies averaged 113 tokens on the H100 run of 2026-12-07, loops cut). A random model neither stops nor loops the way the target does,
so every reply runs to its own budget: no stop token, the loop check run every step but never
cutting (loop_repeats unreachable). The stream path then runs `ReplyStream` on the ids, as
`rewrite_conversations` does for first turns.

tokens/s counts every generated token (stop and cut tokens too) over the decoding wall time,
synchronised. `same as stream` is the share of replies equal to the stream path's token for token
(1.0 in fp32; bf16 may break near-ties differently).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import math
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from dominospec.config import load_params
from dominospec.precision import resolve_dtype
from dominospec.data.chat import render_text
from dominospec.runtime.packed import pack_linears
from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.regenerate.batch_forward import ATTENTIONS, BatchForward
from dominospec.regenerate.decoder import DecodePolicy, ReplyStream
from dominospec.regenerate.kv_batch import SlotKV, grouped_attention_on
from dominospec.regenerate.replies import decode_policy, rewrite_conversations
from dominospec.regenerate.static_decoder import COLUMN_STEP, REFILL, ReplyJob, StaticDecoder
from dominospec.target import DTYPES, Target, TargetIdentity, load_target, pick_device, resolve_source

from common.random_models import TARGET_SHAPES, as_target, random_model, shape_config, word_level_tokenizer

# --random-shape prompt lengths, log-normal in tokens: ShareGPT first turns in SmolLM2's chat template (607 of
# the prepared train split, 2026-12-07) have median 54, mean 126, log-sd 0.85, p90 340 (a heavier tail than this)
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN = 60, 1.0, 8
REPLY_MEAN = 120  # --random-shape reply budgets: exponential mean (capped at max_new_tokens: about 106 on average at 256)
NEVER = 1 << 30  # loop_repeats no reply reaches: the loop check runs, nothing is cut


def first_turn_conversations(args: argparse.Namespace, params, tokenizer) -> list[list[dict]]:
    """--conversations (JSON Lines, .xz allowed) or the prepared train split -> the first --prompts first turns
    whose prompt leaves room for a reply before prepare.max_length, in order."""
    from dominospec.data.dataset import read_dataset  # datasets: not needed by --random-shape
    from dominospec.regenerate.stage import first_turns

    if args.conversations:
        opener = lzma.open if args.conversations.endswith(".xz") else open
        with opener(args.conversations, "rt", encoding="utf-8") as f:
            rows = [json.loads(line)["messages"] for line in f]
    else:
        splits, _ = read_dataset(args.prepared or params.paths.prepared)
        rows = splits["train"].select(range(min(len(splits["train"]), 4 * args.prompts)))["messages"]
    out, kwargs = [], params.target.chat_template_kwargs
    for messages in rows:
        turn = first_turns(messages, 1)
        if turn[-1]["role"] != "assistant":
            continue
        prompt = tokenizer(render_text(tokenizer, turn[:-1], True, kwargs), add_special_tokens=False)["input_ids"]
        if len(prompt) < params.prepare.max_length:
            out.append(turn)
        if len(out) == args.prompts:
            break
    return out


def tiny_target(tparams) -> Target:
    """A random 2-layer Llama (hidden 64) on the target's tokenizer (read alone, no weights)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source, gguf_file, _ = resolve_source(tparams)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    device = pick_device(tparams.device)
    model = LlamaForCausalLM(config).eval().requires_grad_(False).to(device)
    identity = TargetIdentity("tiny random", None, None, "float32", 2, 64, len(tokenizer))
    return Target(model=model, tokenizer=tokenizer, identity=identity, device=device)


def random_shape_jobs(count: int, vocab: int, max_new_tokens: int, max_length: int, median: float = PROMPT_MEDIAN,
                      seed: int = 0) -> list[ReplyJob]:
    """`count` greedy jobs of random prompt ids (log-normal lengths of this median) and exponential reply
    budgets (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    longest = max_length - max_new_tokens
    if longest < PROMPT_MIN:
        raise ValueError(f"max_length {max_length} leaves no room for a prompt beside {max_new_tokens} new tokens")
    lengths = (torch.randn(count, generator=g) * PROMPT_SIGMA + math.log(median)).exp()
    lengths = lengths.round().long().clamp(PROMPT_MIN, longest).tolist()
    budgets = (torch.empty(count).exponential_(1 / REPLY_MEAN, generator=g)).ceil().long().clamp(1, max_new_tokens)
    return [ReplyJob(tuple(torch.randint(3, vocab, (n,), generator=g).tolist()), int(b))
            for n, b in zip(lengths, budgets.tolist())]


def run_stream(target, conversations, cfg, max_length, kwargs) -> tuple[list[list[int]], int, float]:
    """Today's path -> (reply tokens per conversation, tokens generated, seconds)."""
    counted = [0]
    replies, started = [], time.perf_counter()
    for start in range(0, len(conversations), cfg.batch_size):
        chunk = conversations[start : start + cfg.batch_size]
        for r in rewrite_conversations(target, chunk, cfg, max_length, kwargs, None, lambda n: counted.__setitem__(0, counted[0] + n)):
            text = r.messages[-1]["content"] if r.messages else ""
            replies.append(target.tokenizer(text, add_special_tokens=False)["input_ids"])
    _sync(target.device)
    return replies, counted[0], time.perf_counter() - started


def run_stream_ids(target, jobs, cfg, policy, max_length) -> tuple[list[list[int]], int, float]:
    """Today's slot decoder on token ids (--random-shape), chunks of `batch_size` as the stage's
    -> (reply tokens per job, tokens generated, seconds)."""
    replies: list[list[int]] = [[] for _ in jobs]
    generated, started = 0, time.perf_counter()
    for start in range(0, len(jobs), cfg.batch_size):
        chunk = jobs[start : start + cfg.batch_size]
        kv = SlotKV(target.num_layers, len(chunk), capacity=64, limit=max_length + 1, device=target.device)
        with grouped_attention_on(target.model, kv):
            stream = ReplyStream(target.model, kv, policy)
            for k, job in enumerate(chunk):
                stream.start(start + k, list(job.prompt), job.budget)
            while stream.running:
                for i, reply in stream.step():
                    replies[i], generated = reply.tokens, generated + reply.generated
    _sync(target.device)
    return replies, generated, time.perf_counter() - started


def run_static(target, lean, jobs, cfg, policy, attention: str, as_tokens: Callable[[list[int]], list[int]],
               refill: int = REFILL) -> tuple[list[list[int]], int, float, int]:
    """The static path with `attention` (padded | rows | rows:BLOCK_N:WARPS) -> (as_tokens(reply tokens) per
    job, tokens generated, seconds, graphs captured)."""
    capacity = max(len(j.prompt) + j.budget - 1 for j in jobs)
    name, *knobs = attention.split(":")
    forward = BatchForward(lean, cfg.batch_size, -(-capacity // COLUMN_STEP) * COLUMN_STEP, name)
    if knobs:
        forward.rows_knobs = {"block_n": int(knobs[0]), "num_warps": int(knobs[1])}
    decoder = StaticDecoder(forward, policy, max(j.budget for j in jobs), cfg.cuda_graphs, cfg.prefill_tokens, refill)
    replies: list[list[int]] = [[] for _ in jobs]
    generated = [0]

    def on_reply(i, reply):
        replies[i] = as_tokens(reply.tokens)
        generated[0] += reply.generated

    started = time.perf_counter()
    decoder.run(jobs, on_reply)
    _sync(target.device)
    return replies, generated[0], time.perf_counter() - started, len(decoder.graphs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--prepared", default=None, help="a prepared dataset (default: the params' paths.prepared)")
    ap.add_argument("--conversations", default=None, help="JSON Lines of {messages} (gpu_recipe.py pack's file)")
    ap.add_argument("--gguf-dir", default=None, help="the folder holding the params' target.gguf_file")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer model on the target's tokenizer")
    ap.add_argument("--random-shape", nargs="?", const="smollm2-135m", default=None, choices=sorted(TARGET_SHAPES),
                    help="random weights of this shape on random prompt ids: no GGUF, no tokenizer (module docstring)")
    ap.add_argument("--prompt-median", type=float, default=PROMPT_MEDIAN,
                    help="--random-shape: the prompts' median length in tokens (longer: every assistant turn's history)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--slots", type=int, default=32, help="regenerate.batch_size for both paths")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default=None, help="regenerate.dtype (default: the params')")
    ap.add_argument("--prefill-tokens", type=int, default=None)
    ap.add_argument("--attention", default=None, help="comma-separated decode attentions of the static path, each "
                                                      "run --rounds times: padded, rows, or rows:BLOCK_N:WARPS (the "
                                                      "kernel's column block and warps; default: padded,rows on CUDA, "
                                                      "padded elsewhere; rows off CUDA needs TRITON_INTERPRET=1)")
    ap.add_argument("--refill", type=int, default=REFILL, help="the static decoder refills free rows once 1/REFILL "
                                                                 "of them are free")
    ap.add_argument("--rounds", type=int, default=2, help="static runs per attention (the first captures the CUDA graphs)")
    ap.add_argument("--skip-stream", action="store_true", help="only the static path (e.g. at a size today's path "
                                                                  "takes too long for)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    params = load_params(args.params)
    cfg = dataclasses.replace(params.regenerate, batch_size=args.slots, max_new_tokens=args.max_new_tokens,
                              temperature=0.0, dtype=args.dtype or params.regenerate.dtype,
                              prefill_tokens=args.prefill_tokens or params.regenerate.prefill_tokens)
    max_length, kwargs = params.prepare.max_length, params.target.chat_template_kwargs
    if args.random_shape:
        device = pick_device(params.target.device)
        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, device))
        config = shape_config(args.random_shape)
        target = as_target(random_model(config, DTYPES[cfg.dtype], device), word_level_tokenizer(config.vocab_size),
                           f"random {args.random_shape}")
        jobs = random_shape_jobs(args.prompts, config.vocab_size, cfg.max_new_tokens, max_length, args.prompt_median)
        policy = DecodePolicy(stop_ids=(), loop_ngram=cfg.loop_ngram, loop_repeats=NEVER)
        as_tokens: Callable[[list[int]], list[int]] = list
    else:
        tparams = params.target if not args.gguf_dir else dataclasses.replace(params.target, model=args.gguf_dir)
        target = tiny_target(tparams) if args.tiny else load_target(tparams)
        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, target.device))
        target.model.to(DTYPES[cfg.dtype])
        conversations = first_turn_conversations(args, params, target.tokenizer)
        tok, policy = target.tokenizer, decode_policy(target, cfg)
        prompts = [tok(render_text(tok, c[:-1], True, kwargs), add_special_tokens=False)["input_ids"] for c in conversations]
        jobs = [ReplyJob(tuple(p), min(cfg.max_new_tokens, max_length - len(p))) for p in prompts]

        def as_tokens(tokens: list[int]) -> list[int]:  # as the stream path's text comes back
            return tok(tok.decode(tokens, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
    if params.regenerate.num_threads:
        torch.set_num_threads(params.regenerate.num_threads)
    cuda = target.device.type == "cuda"
    attentions = (args.attention or ("padded,rows" if cuda else "padded")).split(",")
    if not all(a in ATTENTIONS or re.fullmatch(r"rows:\d+:\d+", a) for a in attentions):
        raise SystemExit(f"--attention: each of {ATTENTIONS} or rows:BLOCK_N:WARPS, got {args.attention!r}")
    lean = LeanDecoder(target.model, DecoderOps.on(cuda))  # before the packing below
    rows: list[dict] = []
    stream: Optional[list[list[int]]] = None
    with torch.inference_mode():
        if not args.skip_stream:
            if cfg.linear == "packed":
                pack_linears(target.model)  # as the stage does (CPU fp32/bf16; a no-op on CUDA)
            if args.random_shape:
                stream, tokens, seconds = run_stream_ids(target, jobs, cfg, policy, max_length)
            else:
                stream, tokens, seconds = run_stream(target, conversations, cfg, max_length, kwargs)
            rows.append({"path": "stream", "tokens_per_s": tokens / seconds, "replies": len(stream), "tokens": tokens,
                         "seconds": seconds, "same_as_stream": 1.0})
        for attention in attentions:
            for round_ in range(args.rounds):
                static, tokens, seconds, graphs = run_static(target, lean, jobs, cfg, policy, attention, as_tokens,
                                                             args.refill)
                same = None if stream is None else sum(a == b for a, b in zip(static, stream)) / len(stream)
                captures = " (captures graphs)" if round_ == 0 and graphs else ""
                rows.append({"path": f"static {attention}{captures}", "attention": attention, "graphs": graphs,
                             "tokens_per_s": tokens / seconds, "replies": len(static), "tokens": tokens,
                             "seconds": seconds, "same_as_stream": same})
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    prompt_tokens = [len(j.prompt) for j in jobs]
    record = {"device": device, "model": "tiny random" if args.tiny else target.identity.name, "dtype": cfg.dtype,
              "prompts": len(jobs), "prompt_tokens_mean": sum(prompt_tokens) / len(jobs),
              "prompt_tokens_max": max(prompt_tokens), "slots": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
              "loop_ngram": cfg.loop_ngram, "refill": args.refill, "random_shape": args.random_shape, "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"{record['model']}, {device}, {cfg.dtype}, {len(jobs)} prompts (mean {record['prompt_tokens_mean']:.0f} "
          f"tokens, max {max(prompt_tokens)}), {cfg.batch_size} slots, <= {cfg.max_new_tokens} new tokens")
    print("| path | tokens/s | replies | tokens | seconds | same as stream |\n|---|---|---|---|---|---|")
    for r in rows:
        same = "—" if r["same_as_stream"] is None else f"{r['same_as_stream']:.2f}"
        print(f"| {r['path']} | {r['tokens_per_s']:.0f} | {r['replies']} | {r['tokens']} | {r['seconds']:.2f} | {same} |")


if __name__ == "__main__":
    sys.exit(main())
