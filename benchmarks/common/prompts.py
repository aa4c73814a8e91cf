"""Prompt files: `read_prompts` (.pt or JSONL of prompt ids), the pack of benchmarks/draft_study.py
(`flatten`, `unflatten`, `load_packed`, `pack_suites`), `interleave` (suites alternating), `with_answer`
and `reply_blocks` (a prompt and the target's answer as teacher-forced draft blocks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

def read_prompts(path: str | Path) -> dict[str, list[list[int]]]:
    """Prompt ids by suite from a .pt file (a list of id lists or tensors, or {suite: list}) or a JSONL
    of {"prompt_ids": [...], "suite": optional} (benchmarks/export_prompts.py writes one), in file order."""
    path = Path(path)
    if path.suffix == ".pt":
        raw = torch.load(path, weights_only=True)  # prompt ids and tensors only: no pickled objects
        raw = raw if isinstance(raw, dict) else {"prompts": raw}
        return {name: [torch.as_tensor(p).tolist() for p in ps] for name, ps in raw.items()}
    out: dict[str, list[list[int]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.setdefault(row.get("suite", "prompts"), []).append([int(t) for t in row["prompt_ids"]])
    return out


def flatten(seqs: list[torch.Tensor]) -> dict[str, Any]:
    """Sequences of token ids (< 65536) -> {ids: uint16 [sum T], offsets: int64 [n+1]}: small to carry, and
    plain tensors, which `torch.load(weights_only=True)` reads back."""
    lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    flat = torch.cat([s.to(torch.int64) for s in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
    return {"ids": flat.to(torch.uint16), "offsets": lengths.cumsum(0)}


def unflatten(packed: dict[str, Any]) -> list[torch.Tensor]:
    """The inverse of `flatten` -> int64 tensors."""
    ids, off = packed["ids"].to(torch.int64), packed["offsets"].tolist()
    return [ids[off[i]:off[i + 1]] for i in range(len(off) - 1)]


def load_packed(path: str | Path) -> dict[str, Any]:
    """A `benchmarks/draft_study.py pack` file -> {train_prompts, val_prompts: [ids], orig: [(ids, loss_mask)],
    suites: {name: [ids]}, mask_token_id}."""
    raw = torch.load(path, weights_only=True)  # prompt ids and tensors only: no pickled objects
    return {
        "train_prompts": unflatten(raw["train_prompts"]),
        "val_prompts": unflatten(raw["val_prompts"]),
        "orig": list(zip(unflatten(raw["orig_ids"]), [m.bool() for m in unflatten(raw["orig_mask"])])),
        "suites": {k: unflatten(v) for k, v in raw["suites"].items()},
        "mask_token_id": raw["mask_token_id"],
    }


def pack_suites(path: str | Path) -> dict[str, list[list[int]]]:
    """The held-out suites of a `draft_study.py pack` file -> prompt ids by suite."""
    raw = torch.load(path, weights_only=True)  # prompt ids and tensors only: no pickled objects
    return {name: [p.tolist() for p in unflatten(packed)] for name, packed in raw["suites"].items()}


def interleave(by_suite: dict[str, list[list[int]]]) -> list[tuple[str, list[int]]]:
    """{suite: prompts} -> [(suite, prompt)] alternating suites, so a budget cut keeps them balanced."""
    out, i = [], 0
    while any(i < len(ps) for ps in by_suite.values()):
        out += [(name, ps[i]) for name, ps in by_suite.items() if i < len(ps)]
        i += 1
    return out


def with_answer(prompt: list[int] | torch.Tensor, answer: list[int]) -> dict[str, torch.Tensor]:
    """A prompt and its answer -> {input_ids [T] int64, loss_mask [T] bool, True on the answer}."""
    prompt = torch.as_tensor(prompt, dtype=torch.long)
    ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt):] = True
    return {"input_ids": ids, "loss_mask": mask}


def reply_blocks(draft: Any, target: Any, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A prompt and the target's answer -> (target features [1, T, F], anchors [A], BlockBatch): every
    position of the answer but the last as a round's x_start, the draft's block teacher-forced there
    (train.objective.make_blocks, as eval.walk scores a draft)."""
    from dominospec.cache.features import target_hidden
    from dominospec.train.objective import make_blocks

    config, item = draft.config, with_answer(prompt, answer)
    ids, mask = item["input_ids"], item["loss_mask"]
    features = target_hidden(target.model, ids[None], torch.ones_like(ids)[None], list(config.target_layer_ids))
    anchors = torch.arange(len(prompt), ids.numel() - 1)
    blocks = make_blocks(ids[None], mask[None], 0, config.block_size, config.mask_token_id, anchors=[anchors])
    return features, anchors, blocks
