"""The `regenerate` stage: the target rewrites the assistant turns of the train split (optional).

A draft trained on the target's own replies accepts more than one trained on someone else's.

    disabled: paths.prepared --copy--> paths.regenerated (meta "regenerated": 0)
    enabled:  the first `max_conversations` train conversations, sorted by first-prompt length
              (little padding per batch), in chunks of `batch_size`, the target cast to `dtype`
              --rewrite_conversations (batched KV-cache decoding)--> journal
              --original order, render + mask (as prepare)--> paths.regenerated
              the first `max_val_conversations` of val the same way (0: val copied unchanged), so the
              train stage's engine walk measures τ on the target's own replies; test is copied
              unchanged; train (and a rewritten val) hold only the rewritten conversations, followed
              by the next `original_conversations` train conversations with their original replies,
              cut to the same `max_turns` (with train.labels: target the draft learns the target's own
              next token on every position of them: a cache-stage forward, and no decoding).
              With `code_prompts` n > 0, n documented Python functions from `code_prompts_root`
              (data.code_prompts: the standard library by default), each asked to be completed as
              the humaneval suite asks, are answered by the target too (journal split "code"); those
              conversations follow the rewritten ones, before the originals.
              `max_turns` keeps the first n assistant turns of each conversation (null: all).
              Renderings stop at the max_length prepare used (meta.json).

Resumable: each finished chunk is one journal line in `<paths.regenerated>.work/`; a killed run
skips the chunks already there. A chunk's RNG is seeded from (seed, chunk index) and its batch
is always the same conversations (the sort is a function of the data), so a resumed run produces
what an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, concatenate_datasets
from tqdm import tqdm

from dominospec.errors import UserError
from dominospec.config import Params, RegenerateParams
from dominospec.data.chat import TemplateError, TemplateKwargs, render_batch, special_token_ids
from dominospec.data.code_prompts import CodePrompts, code_prompts
from dominospec.data.dataset import FEATURES, META_FILE, empty_split, read_dataset, write_dataset
from dominospec.regenerate.batch_forward import resolve_attention
from dominospec.regenerate.journal import Journal
from dominospec.regenerate.replies import decode_policy, first_prompt_length, rewrite_conversations
from dominospec.regenerate.sequences import regenerate_static
from dominospec.runtime.packed import pack_linears
from dominospec.files import code_digest, replace_path, temp_sibling, write_json
from dominospec.precision import dtype_name, resolve_dtype
from dominospec.target import DTYPES, Target, load_target

COUNTS = ("replies_at_max_new_tokens", "replies_at_max_length", "replies_loop_cut")  # summed into the metrics


def regenerate(params: Params) -> None:
    """Params -> `paths.regenerated` (dataset + meta.json) and `paths.metrics/regenerate.json`."""
    started = time.perf_counter()
    cfg = params.regenerate
    if cfg.enabled:
        _check(cfg)  # before anything is read: a bad key is named first
    splits, meta = read_dataset(params.paths.prepared)
    metrics_path = Path(params.paths.metrics) / "regenerate.json"
    if not cfg.enabled:
        copy_unchanged(Path(params.paths.prepared), Path(params.paths.regenerated), meta)
        summary = {"enabled": False, "conversations_regenerated": 0, "tokens_generated": 0}
        summary["splits"] = {s: len(d) for s, d in splits.items()}
        write_json(metrics_path, {**summary, "seconds": round(time.perf_counter() - started, 2)})
        return
    # read before the target loads: a folder without functions is named before any decoding
    code = code_prompts(cfg.code_prompts_root, cfg.code_prompts) if cfg.code_prompts else None
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    target = load_target(params.target)
    if not target.identity.same_model(meta["target"]):
        raise UserError(
            f"{params.paths.prepared} was prepared for target {meta['target']['name']}, not {target.identity.name}: "
            "re-run the prepare stage"
        )
    target.model.to(DTYPES[resolve_dtype(cfg.dtype, target.device)])
    if cfg.decoder == "static":
        return _regenerate_static(params, target, splits, meta, code, metrics_path, started)
    if cfg.linear == "packed":
        pack_linears(target.model)  # CPU fp32/bf16 only; anything else is left as loaded
    max_length = int(meta["max_length"])
    mask_token_id = int(meta["mask_token_id"])
    out, report = dict(splits), {}
    # train: the draft learns the target's replies; val: the train stage's engine walk
    # (val_walk_acceptance_length) then measures τ on the target's own replies, as evaluate does.
    for split, limit in (("train", cfg.max_conversations), ("val", cfg.max_val_conversations)):
        if split == "val" and not limit:
            continue  # val copied unchanged
        out[split], report[split] = _regenerate_split(target, params, meta, splits[split], split, limit, max_length,
                                                      mask_token_id)
    rewritten, code_train = len(out["train"]), 0
    if code is not None:  # the target's answers to code requests, after the rewritten conversations
        answered, report["code"] = _regenerate_split(target, params, meta, code_dataset(code), "code", None,
                                                     max_length, mask_token_id)
        out["train"], code_train = concatenate_datasets([out["train"].cast(FEATURES), answered.cast(FEATURES)]), len(answered)
    out["train"], originals, original_skipped = with_originals(out["train"], splits["train"], cfg, target.tokenizer,
                                                               max_length, mask_token_id,
                                                               params.target.chat_template_kwargs)
    out = DatasetDict(out)
    write_dataset(params.paths.regenerated, out, {**meta, "regenerated": rewritten, "original_train": originals,
                                                  "code_train": code_train,
                                                  "regenerated_val": len(out["val"]) if "val" in report else 0})
    shutil.rmtree(work_dir(params.paths.regenerated), ignore_errors=True)
    train_report = report["train"]
    entries = train_report.pop("entries")
    val_report, code_report = report.get("val"), report.get("code")
    for extra in (val_report, code_report):
        if extra is not None:
            extra.pop("entries")
    if code_report is not None:
        code_report.update(root=str(code.root), functions_found=code.functions, files_skipped=dict(code.skipped))
    write_json(
        metrics_path,
        {
            "enabled": True,
            "conversations_regenerated": rewritten,
            "original_conversations": originals,  # train rows after the rewritten ones, original replies
            "original_skipped": dict(sorted(original_skipped.items())),
            "conversations_resumed": train_report["resumed"],
            "assistant_turns_regenerated": sum(e["assistant_turns"] for e in entries),
            **{key: sum(e[key] for e in entries) for key in COUNTS},
            "tokens_generated": sum(e["generated_tokens"] for e in entries),
            "tokens_generated_this_run": train_report["new_tokens"],
            "tokens_per_second": train_report["tokens_per_second"],
            "skipped": train_report["skipped"],
            "val": val_report,  # the val split rewritten too (regenerate.max_val_conversations), or null
            "code": code_report,  # the target's answers to regenerate.code_prompts function stubs, or null
            "max_turns": cfg.max_turns,
            "splits": {s: len(d) for s, d in out.items()},
            "temperature": cfg.temperature,
            "max_new_tokens": cfg.max_new_tokens,
            "batch_size": cfg.batch_size,
            "dtype": dtype_name(target.model),
            "linear": cfg.linear,
            "loop_ngram": cfg.loop_ngram or None,
            "torch_threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - started, 2),
        },
    )


def _regenerate_static(params: Params, target: Target, splits: DatasetDict, meta: dict[str, Any],
                       code: CodePrompts | None, metrics_path: Path, started: float) -> None:
    """`regenerate.decoder: static` (regenerate.sequences) -> the dataset and metrics/regenerate.json."""
    cfg = params.regenerate
    try:
        attention = resolve_attention(cfg.attention, target.device)
    except ValueError as error:
        raise UserError(str(error)) from None
    train, val, report = regenerate_static(target, params, meta, splits, decode_policy(target, cfg), code,
                                           work_dir(params.paths.regenerated))
    regenerated = len(train)
    out = dict(splits, train=train, **({} if val is None else {"val": val}))
    out["train"], originals, original_skipped = with_originals(train, splits["train"], cfg, target.tokenizer,
                                                               int(meta["max_length"]), int(meta["mask_token_id"]),
                                                               params.target.chat_template_kwargs)
    out = DatasetDict(out)
    write_dataset(params.paths.regenerated, out, {**meta, "regenerated": regenerated, "original_train": originals,
                                                  "code_train": report["sources"].get("code", {}).get("sequences", 0),
                                                  "regenerated_val": 0 if val is None else len(val)})
    shutil.rmtree(work_dir(params.paths.regenerated), ignore_errors=True)
    sources = report.pop("sources")
    train_sources = {k: v for k, v in sources.items() if k != "val"}
    write_json(metrics_path, {
        "enabled": True, "decoder": "static", "attention": attention,
        "conversations_regenerated": regenerated,  # train sequences labelled by the target, after dedup
        "sequences_by_source": {k: v["sequences"] for k, v in train_sources.items()},
        "original_conversations": originals, "original_skipped": dict(sorted(original_skipped.items())),
        "tokens_generated": sum(v["tokens_generated"] for v in train_sources.values()),
        **{key: sum(v[key] for v in train_sources.values()) for key in COUNTS},
        **report, "sources": sources, "dedup": cfg.dedup, "max_turns": cfg.max_turns,
        "samples": cfg.samples, "sample_temperatures": cfg.sample_temperatures,
        "splits": {s: len(d) for s, d in out.items()}, "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size, "dtype": dtype_name(target.model),
        "loop_ngram": cfg.loop_ngram or None, "device": str(target.device), "torch_threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 2),
    })  # fmt: skip


def _regenerate_split(
    target: Target, params: Params, meta: dict[str, Any], data: Dataset, split: str, limit: Any, max_length: int,
    mask_token_id: int,
) -> tuple[Dataset, dict[str, Any]]:  # fmt: skip
    """The first `limit` conversations of one split -> (the rewritten split, its report with the entries)."""
    cfg = params.regenerate
    count = len(data) if limit is None else min(limit, len(data))
    template_kwargs = params.target.chat_template_kwargs
    chunks = length_sorted_chunks(target.tokenizer, data, count, cfg.batch_size, template_kwargs)
    journal = Journal(work_dir(params.paths.regenerated) / f"journal-{split}.jsonl",
                      {**_fingerprint(cfg, meta, data, count), "chat_template_kwargs": template_kwargs, "split": split})
    done = journal.load()  # chunk index -> journal entries, for the chunks a killed run finished
    resumed = sum(len(chunks[c]) for c in done if c < len(chunks))
    if done:
        print(f"regenerate: resuming {split}, {resumed}/{count} conversations already rewritten", file=sys.stderr)
    new_tokens, seconds = _rewrite_chunks(target, data, chunks, cfg, max_length, template_kwargs, journal, done, split)
    entries = sorted((e for c in range(len(chunks)) for e in done[c]), key=lambda e: e["row"])  # original order
    rewritten, skipped = _render(target.tokenizer, entries, max_length, mask_token_id, template_kwargs)
    journal.remove()
    return rewritten, {
        "entries": entries, "resumed": resumed, "new_tokens": new_tokens,
        "conversations": len(rewritten), "tokens_generated": sum(e["generated_tokens"] for e in entries),
        "tokens_per_second": round(new_tokens / seconds, 2) if seconds else None,
        "skipped": dict(sorted(skipped.items())),
    }


def code_dataset(code: CodePrompts) -> Dataset:
    """Code prompts -> conversations [request, empty reply] for the target to answer (ids "code:...")."""
    return Dataset.from_list([{"id": p.id, "messages": [{"role": "user", "content": p.content},
                                                        {"role": "assistant", "content": ""}]} for p in code.prompts])


def first_turns(messages: list[dict[str, str]], max_turns: Any) -> list[dict[str, str]]:
    """Messages -> those before the (max_turns + 1)-th assistant turn (all when max_turns is null)."""
    if not max_turns:
        return list(messages)
    out, turns = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if turns == max_turns:
                break
            turns += 1
        out.append(m)
    return out


def _rewrite_chunks(
    target: Target, train: Dataset, chunks: list[list[int]], cfg: RegenerateParams, max_length: int,
    chat_template_kwargs: TemplateKwargs, journal: Journal, done: dict[int, list[Any]], split: str = "train",
) -> tuple[int, float]:  # fmt: skip
    """Rewrite every chunk not in `done`, journaling each; fills `done` -> (tokens generated, generation seconds)."""
    new_tokens, generation_seconds = 0, 0.0
    with tqdm(total=sum(map(len, chunks)), desc=f"regenerate {split}", unit="conv") as bar:
        bar.update(sum(len(chunks[c]) for c in done if c < len(chunks)))
        rate = _TokenRate(bar)
        for c, rows in enumerate(chunks):
            if c in done:
                continue
            seed = _chunk_seed(cfg.seed, c) if split == "train" else _chunk_seed(cfg.seed, f"{split}:{c}")
            generator = torch.Generator(target.device).manual_seed(seed)  # same draws, whatever ran before
            tick = time.perf_counter()
            conversations = [first_turns(train[i]["messages"], cfg.max_turns) for i in rows]
            rewritten = rewrite_conversations(target, conversations, cfg, max_length, chat_template_kwargs, generator,
                                              rate.add)
            generation_seconds += time.perf_counter() - tick
            entries = [{"row": i, "id": train[i]["id"], **dataclasses.asdict(r)} for i, r in zip(rows, rewritten)]
            journal.append(c, entries)
            done[c] = entries
            new_tokens += sum(r.generated_tokens for r in rewritten)
            bar.update(len(rows))
    return new_tokens, generation_seconds


class _TokenRate:
    """Generated tokens -> a `tok/s` figure on the progress bar (since the run started)."""

    def __init__(self, bar: tqdm):
        self.bar, self.tokens, self.started, self.shown = bar, 0, time.perf_counter(), 0.0

    def add(self, n: int) -> None:
        self.tokens += n
        now = time.perf_counter()
        if now - self.shown >= 1.0:
            self.bar.set_postfix(tokens=self.tokens, tok_s=f"{self.tokens / (now - self.started):.0f}", refresh=True)
            self.shown = now


def length_sorted_chunks(tokenizer: Any, train: Dataset, count: int, batch_size: int,
                         chat_template_kwargs: TemplateKwargs) -> list[list[int]]:
    """The first `count` rows, sorted by first-prompt length (ties: row order) -> chunks of `batch_size` rows."""
    lengths = [first_prompt_length(tokenizer, train[i]["messages"], chat_template_kwargs) for i in range(count)]
    order = sorted(range(count), key=lambda i: (lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, count, batch_size)]


def with_originals(rewritten: Dataset, train: Dataset, cfg: RegenerateParams, tokenizer: Any, max_length: int,
                   mask_token_id: int, chat_template_kwargs: TemplateKwargs) -> tuple[Dataset, int, Counter]:
    """The rewritten train split + the `original_conversations` prepared train rows that follow the
    rewritten ones (rows max_conversations..), original replies, cut to `max_turns` and rendered
    as prepare renders -> (train split, originals kept, skipped reason -> count)."""
    start = len(train) if cfg.max_conversations is None else min(cfg.max_conversations, len(train))
    stop = min(len(train), start + cfg.original_conversations)
    if stop <= start:  # nothing asked, or every train conversation was rewritten
        return rewritten, 0, Counter()
    rows = train.select(range(start, stop))
    entries = [{"id": r["id"], "messages": through_last_reply(first_turns(r["messages"], cfg.max_turns))} for r in rows]
    originals, skipped = _render(tokenizer, entries, max_length, mask_token_id, chat_template_kwargs)
    return concatenate_datasets([rewritten.cast(FEATURES), originals.cast(FEATURES)]), len(originals), skipped


def through_last_reply(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Messages -> those up to and including the last assistant turn (a trailing prompt has no reply to learn)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[: last + 1]


def work_dir(regenerated: str | Path) -> Path:
    """Where a run keeps its journal: next to the output, outside it (DVC deletes the output first)."""
    regenerated = Path(regenerated)
    return regenerated.with_name(regenerated.name + ".work")


def copy_unchanged(prepared: Path, out: Path, meta: dict[str, Any]) -> None:
    """prepared dataset -> `out`, all splits as they are, meta gaining "regenerated": 0; atomic."""
    tmp = temp_sibling(out)
    shutil.copytree(prepared, tmp)
    (tmp / META_FILE).write_text(json.dumps({**meta, "regenerated": 0}, indent=2) + "\n")
    replace_path(tmp, out)


def _render(tokenizer: Any, entries: list[dict[str, Any]], max_length: int, mask_token_id: int,
            chat_template_kwargs: TemplateKwargs) -> tuple[Dataset, Counter]:
    """Journal entries -> (train split in the dataset format, skipped reason -> count), masked exactly as prepare does."""
    skipped: Counter = Counter()
    rendered = render_batch(tokenizer, [e["messages"] for e in entries], max_length, special_token_ids(tokenizer),
                            chat_template_kwargs)
    rows = []
    for entry, r in zip(entries, rendered):
        if not entry["messages"]:
            skipped["prompt_reaches_max_length"] += 1  # no room left for even one reply
        elif isinstance(r, TemplateError):
            skipped[r.reason] += 1
        elif not r.loss_mask.any():
            skipped["no_assistant_tokens"] += 1
        elif mask_token_id in r.token_ids_seen:
            skipped["contains_mask_token"] += 1  # the reply spelled out the reserved MASK token
        else:
            rows.append(
                {
                    "id": entry["id"],
                    "messages": entry["messages"],
                    "input_ids": r.input_ids,
                    "loss_mask": r.loss_mask,
                    "num_tokens": len(r.input_ids),
                }
            )
    return (Dataset.from_list(rows, features=FEATURES) if rows else empty_split()), skipped


def _fingerprint(cfg: RegenerateParams, meta: dict[str, Any], train: Dataset, count: int) -> dict[str, Any]:
    """What a journal's work depends on: the params, the prepared data's meta, the rows rewritten, the code."""
    h = hashlib.sha256()
    for row in train.select(range(count)).select_columns(["id", "messages"]):
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode())
    return {"regenerate": dataclasses.asdict(cfg), "prepared_meta": meta, "train_rows": h.hexdigest(),
            "code": code_digest()}


def _chunk_seed(seed: int, chunk: Any) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{chunk}".encode()).digest()[:7], "big")


def _check(cfg: RegenerateParams) -> None:
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1:
        raise UserError(
            f"regenerate.batch_size and regenerate.max_new_tokens must be at least 1, got {cfg.batch_size}, {cfg.max_new_tokens}"
        )
    if cfg.loop_ngram is not None and cfg.loop_ngram < 0:
        raise UserError(f"regenerate.loop_ngram must be null, 0 (keep loops) or a positive n-gram length, got {cfg.loop_ngram}")
    if cfg.loop_repeats < 2:
        raise UserError(f"regenerate.loop_repeats must be at least 2 (a loop is a recurring n-gram), got {cfg.loop_repeats}")
    if cfg.num_threads is not None and cfg.num_threads < 1:
        raise UserError(f"regenerate.num_threads must be at least 1 or null (torch's default), got {cfg.num_threads}")
    if cfg.max_turns is not None and cfg.max_turns < 1:
        raise UserError(f"regenerate.max_turns must be at least 1 or null (all turns), got {cfg.max_turns}")
    if cfg.max_val_conversations is not None and cfg.max_val_conversations < 0:
        raise UserError(f"regenerate.max_val_conversations must be >= 0 (0 = copy val unchanged), got {cfg.max_val_conversations}")
    if cfg.code_prompts < 0:
        raise UserError(f"regenerate.code_prompts must be >= 0 (0 = none), got {cfg.code_prompts}")
    if cfg.original_conversations < 0:
        raise UserError(f"regenerate.original_conversations must be >= 0 (0 = only rewritten ones), got {cfg.original_conversations}")
    if cfg.max_conversations is not None and cfg.max_conversations < 1:
        raise UserError(f"regenerate.max_conversations must be at least 1 or null, got {cfg.max_conversations}")
    static = {"samples": cfg.samples, "magpie_prompts": cfg.magpie_prompts, "dedup": cfg.dedup != "none"}
    if cfg.decoder == "stream" and any(static.values()):
        raise UserError(f"regenerate.{next(k for k, v in static.items() if v)} needs regenerate.decoder: static "
                        "(the stream decoder rewrites whole conversations)")
    if cfg.samples < 0 or cfg.magpie_prompts < 0 or any(t <= 0 for t in cfg.sample_temperatures):
        raise UserError("regenerate: samples and magpie_prompts must be >= 0 and every sample_temperature > 0, got "
                        f"{cfg.samples}, {cfg.magpie_prompts}, {cfg.sample_temperatures}")
    if min(cfg.chunk_replies, cfg.prefill_tokens, cfg.magpie_max_prompt_tokens) < 1 or cfg.magpie_temperature <= 0:
        raise UserError("regenerate: chunk_replies, prefill_tokens and magpie_max_prompt_tokens must be >= 1 and "
                        f"magpie_temperature > 0, got {cfg.chunk_replies}, {cfg.prefill_tokens}, "
                        f"{cfg.magpie_max_prompt_tokens}, {cfg.magpie_temperature}")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise UserError(f"regenerate: temperature must be >= 0 and top_p in (0, 1], got {cfg.temperature}, {cfg.top_p}")
