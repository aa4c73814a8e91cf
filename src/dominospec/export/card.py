"""The model card (README.md) of an exported draft: target, data, params, metrics, how to serve it.

Metrics come from the stages' JSON files under `paths.metrics`: prepare.json and cache.json (data),
train.json (validation acceptance). eval.json is written by the evaluate stage, which runs on the
export, so it is shown only when it names these very weights (`draft_sha256`); otherwise the card
says the draft awaits evaluation rather than show another draft's numbers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import yaml

from dominospec.config import Params
from dominospec.export.contract import DOMINO, FORMAT_VERSION, profile

MAX_LIST = 32  # longer lists are summarised by their length


def sglang_lines(params: Params, exported: dict[str, Any]) -> list[str]:
    """-> the card's SGLang launch (built by `dominospec.export.sglang_launch`, as `make serve` runs it), or why
    SGLang cannot serve this target as configured."""
    from dominospec.errors import UserError
    from dominospec.export.sglang_launch import launch_argv, printable

    try:
        argv = launch_argv(params, exported, params.serve.host, params.serve.port)
    except UserError as err:
        return [f"SGLang cannot serve it as configured: {err}.", ""]
    return ["```bash", printable(["python", *argv[1:]]), "```", ""]


def model_card(params: Params, exported: dict[str, Any], weights_sha256: str) -> str:
    """Params + exported config.json + weights hash (+ metrics files) -> README.md text."""
    metrics = Path(params.paths.metrics)
    target, dflash = exported["target"], exported["dflash_config"]
    domino = profile(exported) == DOMINO
    kind = "Domino (DFlash backbone + GRU logit correction)" if domino else "DFlash (block-parallel, no Domino head)"
    block = exported["block_size"]
    launch = sglang_lines(params, exported)
    lines = [
        "---",
        f"base_model: {json.dumps(target['name'])}",
        "tags: [speculative-decoding, dflash" + (", domino" if domino else "") + ", sglang]",
        "---",
        "",
        f"# {kind} draft for `{target['name']}`",
        "",
        f"A speculative-decoding draft: it proposes {block - 1} tokens per target verification "
        f"(block size {block}); the target's output is unchanged. Weights are bf16, without embedding "
        f"or LM head (both are the target's). Export format {FORMAT_VERSION}, weights sha256 `{weights_sha256}`.",
        "",
        "## Target",
        "",
        *_table(target),
        "",
        "## Draft",
        "",
        *_table({
            "block_size": block,
            "draft layers": exported["num_hidden_layers"],
            "hidden_size": exported["hidden_size"],
            "target_layer_ids": dflash["target_layer_ids"],
            "mask_token_id": dflash["mask_token_id"],
            **({"gru_hidden_dim (G)": dflash["gru_hidden_dim"], "emb_dim (r)": dflash["emb_dim"]} if domino else {}),
        }),
        "",
        "## Data",
        "",
        *_metrics_section(metrics / "prepare.json"),
        *_metrics_section(metrics / "cache.json"),
        "## Training parameters",
        "",
        "```yaml",
        yaml.safe_dump({"draft": dataclasses.asdict(params.draft), "train": dataclasses.asdict(params.train)},
                       sort_keys=False).rstrip(),
        "```",
        "",
        "## Evaluation",
        "",
        *_metrics_section(metrics / "train.json"),
        *_eval_section(metrics / "eval.json", weights_sha256),
        "## Serving",
        "",
        "With SGLang (CUDA; `make serve` runs this where SGLang and a GPU are present):",
        "",
        *launch,
    ]
    if domino and launch[0].startswith("```"):
        lines += ["Add `--speculative-domino-candidate-pool-size 0` (`serve.sglang_args`) to score the correction "
                  "on the full vocabulary.", ""]
    lines += [
        "With the built-in server (any machine, CPU included; same API subset):",
        "",
        "```bash",
        "make serve",
        "```",
        "",
        "## ONNX",
        "",
        f"`{params.paths.onnx}`: the block forward (fp32, the target's LM head included) -> base logits and z. "
        f"`{params.paths.onnx_rollout}`: one rollout step (GRU state, corrected logits, argmax). "
        "Inputs, outputs and the driving loop: `dominospec.export.onnx_graphs`.",
        "",
    ]
    return "\n".join(lines)


def _eval_section(path: Path, weights_sha256: str) -> list[str]:
    """eval.json -> its section when it was measured on these weights, else a one-line note."""
    doc = _read_json(path)
    if doc is None:
        return ["Not evaluated yet: the evaluate stage runs on this export after it is written (`dvc repro`) "
                f"and records these weights' sha256 in `{path}` as `draft_sha256`.", ""]
    if doc.get("draft_sha256") != weights_sha256:
        return [f"`{path}` was not measured on these weights (its `draft_sha256` differs): the evaluate stage, "
                "which runs on this export after it is written, replaces it.", ""]
    return _metrics_section(path)


def _metrics_section(path: Path) -> list[str]:
    """A metrics JSON file -> a titled table of its entries (nothing when the file is absent)."""
    doc = _read_json(path)
    if doc is None:
        return []
    return [f"From `{path.name}`:", "", *_table(_flatten(doc)), ""]


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return doc if isinstance(doc, dict) else {"value": doc}


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b": value}."""
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _table(rows: dict[str, Any]) -> list[str]:
    """{name: value} -> Markdown table lines."""
    return ["| | |", "|---|---|", *(f"| {name} | {_format(value)} |" for name, value in rows.items())]


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            return f"[{len(value)} values]"
        return "[" + ", ".join(_format(v) for v in value) + "]"
    if value is None:
        return "–"
    return str(value).replace("|", "\\|")
