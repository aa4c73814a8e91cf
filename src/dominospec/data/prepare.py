"""The `prepare` stage: conversations -> chat-template token ids with assistant loss masks, split train/val/test.

    source --read--> records --normalise, dedup--> conversations --split by id hash-->
    --drop train conversations opening with a val/test prompt (conversations.held_out)-->
    --render + tokenize + mask (datasets.map, num_proc)--> paths.prepared + metrics/prepare.json

Only the tokenizer and the identity of the target are needed, not its weights. Every record
that does not make it into the output is counted in `skipped` under a reason.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from datasets import Dataset, DatasetDict, Features, List, Value

from dominospec.errors import UserError
from dominospec.config import Params, PrepareParams
from dominospec.data.chat import TemplateError, render_batch, special_token_ids
from dominospec.data.conversations import SPLITS, assign_split, held_out, normalize_records
from dominospec.data.dataset import FEATURES, FORMAT_VERSION, write_dataset
from dominospec.files import write_json
from dominospec.data.sources import read_source
from dominospec.data.target_meta import identity_without_weights, load_tokenizer
from dominospec.target import mask_token_candidates

RENDER_BATCH = 64  # conversations per tokenizer call
# Columns of the working table: the dataset's, plus bookkeeping dropped before writing.
_WORK_FEATURES = Features(
    {
        **FEATURES,
        "split": Value("string"),
        "skip": Value("string"),  # "" = kept, else the reason
        "truncated": Value("bool"),
        "assistant_tokens": Value("int32"),  # sum of loss_mask
        "candidates_seen": List(Value("int32")),  # mask-token candidates occurring in the conversation
    }
)


def prepare(params: Params) -> None:
    """Params -> `paths.prepared` (DatasetDict + meta.json) and `paths.metrics/prepare.json`."""
    started = time.perf_counter()
    cfg = params.prepare
    _check(cfg)
    raw = read_source(cfg.source, cfg.hub_split)  # first: bad input fails before anything slow
    conversations, skipped, dropped = normalize_records(raw.records)
    skipped.update(raw.skipped)
    if not conversations:
        raise UserError(f"prepare.source {cfg.source}: no usable conversation (skipped: {dict(skipped)})")
    for c in conversations:
        c["split"] = assign_split(c["id"], cfg.split_seed, cfg.val_fraction, cfg.test_fraction)
    conversations, leaked = held_out(conversations)
    if leaked:
        skipped["train_prompt_held_out"] += leaked

    tokenizer = load_tokenizer(params.target)
    identity = identity_without_weights(params.target)
    candidates = mask_token_candidates(tokenizer, params.target.mask_token_id)
    if params.target.mask_token_id is not None and not 0 <= params.target.mask_token_id < len(tokenizer):
        raise UserError(f"target.mask_token_id {params.target.mask_token_id} is not a token id (vocab {len(tokenizer)})")

    table = tokenize(conversations, tokenizer, cfg, candidates, params.target.chat_template_kwargs)
    skipped.update(s for s in table["skip"] if s)
    kept = table.select(np.flatnonzero(np.asarray(table["skip"]) == ""))
    if len(kept) == 0:
        raise UserError(f"prepare.source {cfg.source}: no usable conversation (skipped: {dict(skipped)})")
    mask_token_id = choose_mask_token(candidates, kept["candidates_seen"], params.target.mask_token_id, tokenizer)

    split_of = np.asarray(kept["split"])
    columns = list(FEATURES)
    splits = DatasetDict({s: kept.select(np.flatnonzero(split_of == s)).select_columns(columns) for s in SPLITS})
    meta = {
        "format_version": FORMAT_VERSION,
        "target": identity.as_dict(),
        "mask_token_id": mask_token_id,
        "max_length": cfg.max_length,
        "source": raw.source,
    }
    write_dataset(params.paths.prepared, splits, meta)

    num_tokens = np.asarray(kept["num_tokens"], dtype=np.int64)
    write_json(
        Path(params.paths.metrics) / "prepare.json",
        {
            "source": raw.source,
            "conversations_read": len(raw.records),
            "conversations_kept": len(kept),
            "skipped": dict(sorted(skipped.items())),
            "dropped_messages": dict(sorted(dropped.items())),
            "splits": {s: len(splits[s]) for s in SPLITS},
            "tokens": int(num_tokens.sum()),
            "assistant_tokens": int(np.sum(kept["assistant_tokens"], dtype=np.int64)),
            "truncated_conversations": int(np.sum(kept["truncated"])),
            "max_length": cfg.max_length,
            "mask_token_id": mask_token_id,
            "mask_token": tokenizer.convert_ids_to_tokens(mask_token_id),
            "seconds": round(time.perf_counter() - started, 2),
        },
    )


def tokenize(conversations: list[dict[str, Any]], tokenizer: Any, cfg: PrepareParams, candidates: list[int],
             chat_template_kwargs: Mapping[str, Any]) -> Dataset:
    """Normalised conversations (with "split") + template variables -> working table: dataset columns +
    split/skip/truncated/candidates_seen."""
    table = Dataset.from_list(
        [{"id": c["id"], "messages": c["messages"], "split": c["split"]} for c in conversations],
        features=Features({"id": FEATURES["id"], "messages": FEATURES["messages"], "split": Value("string")}),
    )
    num_proc = cfg.num_proc if len(table) >= cfg.num_proc * RENDER_BATCH else None  # tiny inputs: no workers
    return table.map(
        _render_rows,
        batched=True,
        batch_size=RENDER_BATCH,
        num_proc=num_proc,
        features=_WORK_FEATURES,
        fn_kwargs=dict(
            tokenizer=tokenizer,
            max_length=cfg.max_length,
            special_ids=special_token_ids(tokenizer),
            candidates=np.asarray(candidates, dtype=np.int64),
            chat_template_kwargs=dict(chat_template_kwargs),
        ),
        new_fingerprint=uuid.uuid4().hex,  # never reuse a cache; skips hashing the tokenizer
        desc="render + tokenize",
    )


def choose_mask_token(candidates: list[int], seen: list[list[int]], configured: int | None, tokenizer: Any) -> int:
    """The first candidate id that occurs in no kept conversation; UserError when none (or the configured one) is free."""
    occurring = {tid for ids in seen for tid in ids}
    for tid in candidates:
        if tid not in occurring:
            return int(tid)
    if configured is not None:
        token = tokenizer.convert_ids_to_tokens(configured)
        raise UserError(f"target.mask_token_id {configured} ({token!r}) occurs in the data: choose an unused token")
    raise UserError(f"no mask token: every candidate special token {candidates} occurs in the data; set target.mask_token_id")


def _render_rows(batch: dict[str, list], tokenizer: Any, max_length: int, special_ids: set[int], candidates: np.ndarray,
                 chat_template_kwargs: dict[str, Any]):
    """datasets.map body: a batch of conversations -> the working columns."""
    names = ("input_ids", "loss_mask", "num_tokens", "skip", "truncated", "assistant_tokens", "candidates_seen")
    out: dict[str, list] = {k: [] for k in names}
    for rendered in render_batch(tokenizer, batch["messages"], max_length, special_ids, chat_template_kwargs):
        if isinstance(rendered, TemplateError):
            # typed empty rows: a batch mixing [] with int32 arrays fails arrow's concatenation
            skip, ids, mask, seen, truncated = rendered.reason, np.zeros(0, np.int32), np.zeros(0, np.int8), [], False
        else:
            ids, mask, truncated = rendered.input_ids, rendered.loss_mask, rendered.truncated
            seen = np.intersect1d(rendered.token_ids_seen, candidates).tolist()
            skip = "" if mask.any() else "no_assistant_tokens"
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["num_tokens"].append(len(ids))
        out["skip"].append(skip)
        out["truncated"].append(truncated)
        out["assistant_tokens"].append(int(np.sum(mask)))
        out["candidates_seen"].append(seen)
    return out


def _check(cfg: PrepareParams) -> None:
    for key, value in (("val_fraction", cfg.val_fraction), ("test_fraction", cfg.test_fraction)):
        if not 0.0 <= value < 1.0:
            raise UserError(f"prepare.{key} must be in [0, 1), got {value}")
    if cfg.val_fraction + cfg.test_fraction >= 1.0:
        raise UserError("prepare.val_fraction + prepare.test_fraction must leave some conversations for training")
    if cfg.max_length < 2:
        raise UserError(f"prepare.max_length must be at least 2, got {cfg.max_length}")
    if cfg.num_proc < 1:
        raise UserError(f"prepare.num_proc must be at least 1, got {cfg.num_proc}")
