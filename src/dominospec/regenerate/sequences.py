"""The regenerate stage on the static decoder (`regenerate.decoder: static`): prompts -> replies -> sequences.

    train  prompts: every assistant turn of the first max_conversations train conversations (the
           first max_turns), then the code requests, then the prompts the target writes itself
           (magpie_prompts, filtered: `prompts.magpie_verdict`, and exact repeats dropped)
           -> each answered by the main reply and `samples` replies at each sample_temperature
           -> one sequence per reply, deduplicated (`dedup`), in that order
    val    the first max_val_conversations val conversations' turns, main reply only (no dedup)

A sequence is exactly what the target saw and wrote: the prompt's rendering with the generation
prompt (token ids as tokenized) + the reply's tokens + the stop token it ended on (none for a reply
cut at its budget or at a loop). Its loss mask is 1 on the reply and its stop token; the messages
column holds the prompt's messages and the decoded reply. A reply with no token is skipped
(`empty_reply`), as is a sequence holding the MASK token.

Each phase ("train", "magpie_prompts", "val") decodes its jobs sorted by prompt length, in chunks
of `chunk_replies`; a chunk is one journal line once all its replies are in (`journal.Journal`,
`<paths.regenerated>.work/journal-static-<phase>.jsonl`), so a killed run redoes only the chunks
in flight. The fingerprint holds every job (prompt ids, budget, temperature, seed), the params and
the code, and each reply depends on its job alone (greedy, or seeded per reply), so a resumed run
gives what an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from datasets import Dataset
from tqdm import tqdm

from dominospec.config import Params, RegenerateParams
from dominospec.data.chat import special_token_ids
from dominospec.data.code_prompts import CodePrompts
from dominospec.data.dataset import FEATURES, empty_split
from dominospec.files import code_digest
from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.regenerate.batch_forward import BatchForward, resolve_attention
from dominospec.regenerate.decoder import DecodePolicy, Reply
from dominospec.regenerate.dedup import Dedup
from dominospec.regenerate.journal import Journal
from dominospec.regenerate.prompts import (JobOf, Prompt, code_chat_prompts, conversation_prompts, magpie_prefix,
                                           magpie_verdict, reply_jobs, sequence_id, variants)
from dominospec.regenerate.picking import seed_of
from dominospec.regenerate.static_decoder import COLUMN_STEP, ReplyJob, StaticDecoder
from dominospec.target import Target


def regenerate_static(target: Target, params: Params, meta: dict[str, Any], splits: Any, policy: DecodePolicy,
                      code: Optional[CodePrompts], journal_dir: Path) -> tuple[Dataset, Optional[Dataset], dict]:
    """The prepared splits -> (train sequences, val sequences or None, report with counts per source)."""
    cfg, tokenizer = params.regenerate, target.tokenizer
    kwargs, max_length = params.target.chat_template_kwargs, int(meta["max_length"])
    base = {"regenerate": dataclasses.asdict(cfg), "prepared_meta": meta, "code": code_digest(),
            "chat_template_kwargs": kwargs}
    runner = _Runner(target, cfg, policy, journal_dir, base)
    count = len(splits["train"]) if cfg.max_conversations is None else min(cfg.max_conversations, len(splits["train"]))
    prompts = conversation_prompts(splits["train"], count, cfg.max_turns, "sharegpt")
    prompts += code_chat_prompts(code) if code is not None else []
    magpie = None
    if cfg.magpie_prompts:
        written, magpie = self_written_prompts(runner, tokenizer, cfg, kwargs)
        prompts += written
    jobs, of = reply_jobs(tokenizer, prompts, variants(cfg), cfg, max_length, kwargs)
    replies = runner.decode("train", jobs)
    train, sources = to_sequences(tokenizer, prompts, jobs, of, replies, Dedup(cfg.dedup), int(meta["mask_token_id"]),
                                  cfg.max_new_tokens)
    val = None
    if cfg.max_val_conversations:
        count = min(cfg.max_val_conversations, len(splits["val"]))
        val_prompts = conversation_prompts(splits["val"], count, cfg.max_turns, "val")
        jobs, of = reply_jobs(tokenizer, val_prompts, variants(cfg, greedy_only=True), cfg, max_length, kwargs)
        val, val_sources = to_sequences(tokenizer, val_prompts, jobs, of, runner.decode("val", jobs), Dedup("none"),
                                        int(meta["mask_token_id"]), cfg.max_new_tokens)
        sources["val"] = val_sources.get("val", {})
    report = {"sources": sources, "magpie_prompts": magpie, "resumed_replies": runner.resumed, "tokens_generated_this_run": runner.new_tokens,
              "tokens_per_second": round(runner.new_tokens / runner.seconds, 1) if runner.seconds else None,
              "decode_seconds": round(runner.seconds, 2), "cuda_graphs": runner.graph_report()}
    return train, val, report


def self_written_prompts(runner: "_Runner", tokenizer: Any, cfg: RegenerateParams,
                         kwargs: Any) -> tuple[list[Prompt], dict[str, Any]]:
    """`magpie_prompts` continuations of the template's user prefix -> (the kept prompts, counts by verdict)."""
    prefix = tuple(tokenizer(magpie_prefix(tokenizer, kwargs), add_special_tokens=False)["input_ids"])
    jobs = [ReplyJob(prefix, cfg.magpie_max_prompt_tokens, cfg.magpie_temperature, seed_of(cfg.seed, "magpie", i))
            for i in range(cfg.magpie_prompts)]
    replies = runner.decode("magpie_prompts", jobs)
    texts = tokenizer.batch_decode([r.tokens for r in replies], skip_special_tokens=True)
    special, seen, verdicts, kept = special_token_ids(tokenizer), Dedup("text"), Counter(), []
    for i, (reply, text) in enumerate(zip(replies, texts)):
        reason = magpie_verdict(reply, text, special, cfg.magpie_min_prompt_tokens)
        if reason is None and not seen.first("magpie", (), [{"role": "user", "content": text}]):
            reason = "duplicate"
        verdicts[reason or "kept"] += 1
        if reason is None:
            kept.append(Prompt("magpie", f"magpie:{i}", (("user", text.strip()),)))
    return kept, {"asked": len(jobs), **dict(sorted(verdicts.items()))}


def to_sequences(
    tokenizer: Any, prompts: Sequence[Prompt], jobs: Sequence[ReplyJob], of: Sequence[JobOf], replies: Sequence[Reply],
    dedup: Dedup, mask_token_id: int, max_new_tokens: int,
) -> tuple[Dataset, dict[str, dict[str, Any]]]:  # fmt: skip
    """Replies in job order -> (the kept sequences as dataset rows, per source: counts)."""
    texts = tokenizer.batch_decode([r.tokens for r in replies], skip_special_tokens=True)
    sources: dict[str, dict[str, Any]] = {}
    for p in prompts:
        sources.setdefault(p.source, {"prompts": 0, "replies": 0, "tokens_generated": 0, "replies_stopped": 0,
                                      "replies_loop_cut": 0, "replies_at_max_new_tokens": 0, "replies_at_max_length": 0,
                                      "skipped": Counter(), "duplicates": 0, "sequences": 0})["prompts"] += 1
    rows = []
    for job, which, reply, text in zip(jobs, of, replies, texts):
        prompt = prompts[which.prompt]
        counts = sources[prompt.source]
        counts["replies"] += 1
        counts["tokens_generated"] += reply.generated
        counts["replies_stopped"] += reply.stopped
        counts["replies_loop_cut"] += reply.loop_cut
        capped = not reply.stopped and not reply.loop_cut and reply.generated >= job.budget
        counts["replies_at_max_new_tokens"] += capped and job.budget == max_new_tokens
        counts["replies_at_max_length"] += capped and job.budget < max_new_tokens
        ids = list(job.prompt) + reply.tokens + ([reply.stop] if reply.stop is not None else [])
        messages = prompt.as_messages() + [{"role": "assistant", "content": text}]
        if not reply.tokens:
            counts["skipped"]["empty_reply"] += 1
        elif mask_token_id in ids:
            counts["skipped"]["contains_mask_token"] += 1
        elif dedup.first(prompt.source, ids, messages):
            rows.append({"id": sequence_id(prompt, which), "messages": messages, "input_ids": ids,
                         "loss_mask": [0] * len(job.prompt) + [1] * (len(ids) - len(job.prompt)),
                         "num_tokens": len(ids)})
            counts["sequences"] += 1
    skipped_by_source = Counter(prompts[i].source for i in _skipped_prompt_indices(prompts, of))
    for source, counts in sources.items():
        counts["duplicates"] = dedup.duplicates[source]
        if skipped_by_source[source]:
            counts["skipped"]["prompt_reaches_max_length"] += skipped_by_source[source]
        counts["skipped"] = dict(sorted(counts["skipped"].items()))
    return (Dataset.from_list(rows, features=FEATURES) if rows else empty_split()), sources


def _skipped_prompt_indices(prompts: Sequence[Prompt], of: Sequence[JobOf]) -> list[int]:
    """Prompts that got no job (no room before max_length)."""
    answered = {j.prompt for j in of}
    return [i for i in range(len(prompts)) if i not in answered]


class _Runner:
    """Decodes a phase's jobs with journaled chunks; adds up what this run decoded."""

    def __init__(self, target: Target, cfg: RegenerateParams, policy: DecodePolicy, journal_dir: Path,
                 base: dict[str, Any]):
        self.target, self.cfg, self.policy, self.journal_dir, self.base = target, cfg, policy, journal_dir, base
        self.resumed, self.new_tokens, self.seconds = 0, 0, 0.0
        self.lean: Optional[LeanDecoder] = None
        self.captured, self.failed = 0, {}  # CUDA graphs over the phases; shapes whose capture failed (ran eagerly)

    def decode(self, phase: str, jobs: Sequence[ReplyJob]) -> list[Reply]:
        """Jobs -> their replies, in job order; finished chunks of a killed run are read from the journal."""
        order = sorted(range(len(jobs)), key=lambda i: (len(jobs[i].prompt), i))
        chunks = [order[i : i + self.cfg.chunk_replies] for i in range(0, len(order), self.cfg.chunk_replies)]
        journal = Journal(self.journal_dir / f"journal-static-{phase}.jsonl",
                          {**self.base, "phase": phase, "jobs": _jobs_digest(jobs)})
        done = journal.load()
        replies: list[Optional[Reply]] = [None] * len(jobs)
        for c, entries in done.items():
            for j, tokens, generated, stop, loop_cut in entries:
                replies[j] = Reply(tokens, generated, stop is not None, loop_cut, [], stop)
        self.resumed += sum(len(chunks[c]) for c in done if c < len(chunks))
        if done:
            print(f"regenerate: resuming {phase}, {sum(r is not None for r in replies)}/{len(jobs)} replies journaled",
                  file=sys.stderr)
        pending = [j for c, chunk in enumerate(chunks) if c not in done for j in chunk]
        if pending:
            self._run(phase, jobs, chunks, done, pending, journal, replies)
        return replies  # type: ignore[return-value]

    def _run(self, phase: str, jobs: Sequence[ReplyJob], chunks: list[list[int]], done: dict, pending: list[int],
             journal: Journal, replies: list[Optional[Reply]]) -> None:
        chunk_of = {j: c for c, chunk in enumerate(chunks) if c not in done for j in chunk}
        left = {c: len(chunks[c]) for c in set(chunk_of.values())}
        entries: dict[int, list] = {c: [] for c in left}
        bar = tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc=f"regenerate {phase}", unit="reply")

        def on_reply(k: int, reply: Reply) -> None:
            j = pending[k]
            c, replies[j] = chunk_of[j], reply
            entries[c].append([j, reply.tokens, reply.generated, reply.stop, reply.loop_cut])
            self.new_tokens += reply.generated
            left[c] -= 1
            if left[c] == 0:
                journal.append(c, sorted(entries.pop(c)))
            bar.update(1)

        wanted = [jobs[j] for j in pending]
        capacity = max(len(job.prompt) + job.budget - 1 for job in wanted)
        decoder = self._decoder(-(-capacity // COLUMN_STEP) * COLUMN_STEP, max(job.budget for job in wanted))
        started = time.perf_counter()
        decoder.run(wanted, on_reply)
        if decoder.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - started
        bar.close()
        self.captured += len(decoder.graphs)
        self.failed.update({f"{phase} {key}": error for key, error in decoder.failures.items()})
        del decoder  # its cache, state and graphs go before the next phase's are made

    def _decoder(self, capacity: int, longest_reply: int) -> StaticDecoder:
        """A static decoder of `batch_size` slots and `capacity` columns on the target's lean layers."""
        if self.lean is None:  # its fused q/k/v and gate/up weights: built once
            self.lean = LeanDecoder(self.target.model, DecoderOps.on(self.target.device.type == "cuda"))
        forward = BatchForward(self.lean, self.cfg.batch_size, capacity,
                               resolve_attention(self.cfg.attention, self.target.device))
        return StaticDecoder(forward, self.policy, longest_reply, graphs=self.cfg.cuda_graphs,
                             prefill_tokens=self.cfg.prefill_tokens)

    def graph_report(self) -> dict[str, Any]:
        """Graphs captured and shapes whose capture failed (run eagerly), over the phases."""
        return {"captured": self.captured, "failed": self.failed}


def _jobs_digest(jobs: Sequence[ReplyJob]) -> str:
    """Jobs -> sha256 of every job's prompt ids, budget, temperature and seed."""
    h = hashlib.sha256()
    for job in jobs:
        h.update(np.asarray(job.prompt, dtype=np.int64).tobytes())
        h.update(repr((job.budget, job.temperature, job.seed)).encode())
    return h.hexdigest()
