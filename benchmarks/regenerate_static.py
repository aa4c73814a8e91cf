"""Regeneration speed: today's slot decoder (`regenerate.decoder: stream`) beside the static batched
decoder (`static`), on the same ShareGPT first turns, in one process; the table comes last.

    # CPU, a tiny budget (the embedded SmolLM2, or --tiny: a random 2-layer model on its tokenizer)
    python benchmarks/regenerate_static.py --prompts 32 --max-new-tokens 32 --slots 32
    # one GPU: the prompts packed by benchmarks/gpu_recipe.py, the GGUF's folder
    python benchmarks/regenerate_static.py --conversations .carry/recipe/conversations.jsonl.xz \\
        --gguf-dir DIR --prompts 4096 --slots 1024 --max-new-tokens 256 --out speed.json

Each path decodes the first `--prompts` first turns greedily (regenerate.temperature 0) with the
params' dtype, loop rule and budget: `stream` through `replies.rewrite_conversations` in chunks of
`--slots` conversations, as the stage runs it (with its CPU linear packing); `static` through
`StaticDecoder` with `--slots` slots (CUDA graphs on CUDA), its first run capturing the graphs and
a second run warm (`--rounds`). tokens/s counts every generated token (stop and cut tokens too)
over the decoding wall time, synchronised. `same as stream` is the share of replies equal to the
stream path's token for token (1.0 in fp32; bf16 may break near-ties differently).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import sys
import time
from pathlib import Path

import torch

from dominospec.config import load_params
from dominospec.precision import resolve_dtype
from dominospec.data.chat import render_text
from dominospec.data.dataset import read_dataset
from dominospec.engine.packed import pack_linears
from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.regenerate.batch_forward import BatchForward
from dominospec.regenerate.replies import decode_policy, rewrite_conversations
from dominospec.regenerate.static_decoder import COLUMN_STEP, ReplyJob, StaticDecoder
from dominospec.regenerate.stage import first_turns
from dominospec.target import DTYPES, Target, TargetIdentity, load_target, pick_device, resolve_source


def first_turn_conversations(args: argparse.Namespace, params, tokenizer) -> list[list[dict]]:
    """--conversations (JSON Lines, .xz allowed) or the prepared train split -> the first --prompts first turns
    whose prompt leaves room for a reply before prepare.max_length, in order."""
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


def run_static(target, lean, conversations, cfg, max_length, kwargs) -> tuple[list[list[int]], int, float, int]:
    """The static path -> (reply tokens per conversation, tokens generated, seconds, graphs captured)."""
    tok = target.tokenizer
    prompts = [tok(render_text(tok, c[:-1], True, kwargs), add_special_tokens=False)["input_ids"] for c in conversations]
    jobs = [ReplyJob(tuple(p), min(cfg.max_new_tokens, max_length - len(p))) for p in prompts]
    capacity = max(len(j.prompt) + j.budget - 1 for j in jobs)
    forward = BatchForward(lean, cfg.batch_size, -(-capacity // COLUMN_STEP) * COLUMN_STEP)
    decoder = StaticDecoder(forward, decode_policy(target, cfg), max(j.budget for j in jobs), cfg.cuda_graphs,
                            cfg.prefill_tokens)
    replies: list[list[int]] = [[] for _ in jobs]
    generated = [0]

    def on_reply(i, reply):
        replies[i] = tok(tok.decode(reply.tokens, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
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
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--slots", type=int, default=32, help="regenerate.batch_size for both paths")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default=None, help="regenerate.dtype (default: the params')")
    ap.add_argument("--prefill-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2, help="static runs (the first captures the CUDA graphs)")
    ap.add_argument("--skip-stream", action="store_true", help="only the static path (e.g. at a size today's path "
                                                                  "takes too long for)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    params = load_params(args.params)
    tparams = params.target if not args.gguf_dir else dataclasses.replace(params.target, model=args.gguf_dir)
    target = tiny_target(tparams) if args.tiny else load_target(tparams)
    cfg = dataclasses.replace(params.regenerate, batch_size=args.slots, max_new_tokens=args.max_new_tokens,
                              temperature=0.0, dtype=args.dtype or params.regenerate.dtype,
                              prefill_tokens=args.prefill_tokens or params.regenerate.prefill_tokens)
    target.model.to(DTYPES[resolve_dtype(cfg.dtype, target.device)])
    if params.regenerate.num_threads:
        torch.set_num_threads(params.regenerate.num_threads)
    conversations = first_turn_conversations(args, params, target.tokenizer)
    max_length, kwargs = params.prepare.max_length, params.target.chat_template_kwargs
    lean = LeanDecoder(target.model, DecoderOps.on(target.device.type == "cuda"))  # before the packing below
    rows = []
    with torch.inference_mode():
        if not args.skip_stream:
            if cfg.linear == "packed":
                pack_linears(target.model)  # as the stage does (CPU fp32/bf16; a no-op on CUDA)
            stream, tokens, seconds = run_stream(target, conversations, cfg, max_length, kwargs)
            rows.append({"path": "stream", "tokens_per_s": tokens / seconds, "replies": len(stream), "tokens": tokens,
                         "seconds": seconds, "same_as_stream": 1.0})
        for round_ in range(args.rounds):
            static, tokens, seconds, graphs = run_static(target, lean, conversations, cfg, max_length, kwargs)
            same = None if args.skip_stream else sum(a == b for a, b in zip(static, stream)) / len(stream)
            rows.append({"path": f"static{' (captures graphs)' if round_ == 0 and graphs else ''}", "graphs": graphs,
                         "tokens_per_s": tokens / seconds, "replies": len(static), "tokens": tokens, "seconds": seconds,
                         "same_as_stream": same})
    device = torch.cuda.get_device_name(0) if target.device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    record = {"device": device, "model": "tiny random" if args.tiny else target.identity.name, "dtype": cfg.dtype,
              "prompts": len(conversations), "slots": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
              "loop_ngram": cfg.loop_ngram, "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"{record['model']}, {device}, {cfg.dtype}, {len(conversations)} first turns, {cfg.batch_size} slots, "
          f"<= {cfg.max_new_tokens} new tokens")
    print("| path | tokens/s | replies | tokens | seconds | same as stream |\n|---|---|---|---|---|---|")
    for r in rows:
        same = "—" if r["same_as_stream"] is None else f"{r['same_as_stream']:.2f}"
        print(f"| {r['path']} | {r['tokens_per_s']:.0f} | {r['replies']} | {r['tokens']} | {r['seconds']:.2f} | {same} |")


if __name__ == "__main__":
    sys.exit(main())
