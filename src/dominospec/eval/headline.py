"""The `headline` stage: a handful of numbers per suite, read at a glance with `dvc metrics show metrics/headline.json`.

`headline(params)` reads two metrics files under `paths.metrics` and writes `headline.json` (atomic):

  {"<suite>": {"tau", "speedup_vs_ar", "speedup_vs_ngram", "exact_match", "served_tau", "served_tokens_per_s"}}

  from eval.json (the evaluate stage; the draft's own mode, `spec_mode`: Domino for a Domino draft)
    tau                  suites.<suite>.acceptance_length: pooled τ of the engine
    speedup_vs_ar        suites.<suite>.speedup: its tokens/s over AR's on the same prompts
    speedup_vs_ngram     suites.<suite>.speedup_over_ngram: over prompt lookup's
    exact_match          suites.<suite>.exact_match: share of prompts whose greedy output equals AR's
  from serve_eval.json (the serve_eval stage), one request in flight (level c1)
    served_tau           suites.<suite>.c1.acceptance_length (null where the server sends no meta_info)
    served_tokens_per_s  suites.<suite>.c1.tokens_per_s

Every suite of eval.json is a row. A suite serve_eval.json lists under `empty_suites` gets null
served numbers; any other missing key is a UserError naming the key and the file. When both files
name their draft (`draft_sha256`), they must name the same one: the row never mixes two drafts.
Numbers are rounded to `headline.digits` decimals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from dominospec.config import Params
from dominospec.errors import UserError
from dominospec.files import write_json

ENGINE_KEYS = {"tau": "acceptance_length", "speedup_vs_ar": "speedup", "speedup_vs_ngram": "speedup_over_ngram",
               "exact_match": "exact_match"}  # headline key -> eval.json key of each suite
SERVED_KEYS = {"served_tau": "acceptance_length", "served_tokens_per_s": "tokens_per_s"}  # -> serve_eval.json c1
SERVED_LEVEL = "c1"


def headline(params: Params) -> dict[str, Any]:
    """Params -> eval.json + serve_eval.json -> headline.json (written), the document returned."""
    digits = params.headline.digits
    if digits < 0:
        raise UserError(f"headline.digits must be >= 0, got {digits}")
    metrics = Path(params.paths.metrics)
    rows = headline_rows(metrics / "eval.json", metrics / "serve_eval.json", digits)
    out = metrics / "headline.json"
    write_json(out, rows)
    for suite, row in rows.items():
        print(f"{suite}: " + ", ".join(f"{key} {value}" for key, value in row.items()))
    print(f"wrote {out}")
    return rows


def headline_rows(eval_json: Path, serve_json: Path, digits: int) -> dict[str, dict[str, Optional[float]]]:
    """The two metrics files -> {suite: {headline key: number | None}}; UserError naming a missing key and its file."""
    engine, served = read_json(eval_json), read_json(serve_json)
    engine_draft, served_draft = engine.get("draft_sha256"), served.get("draft_sha256")
    if engine_draft and served_draft and engine_draft != served_draft:
        raise UserError(f"{eval_json} and {serve_json} describe different drafts (draft_sha256 {engine_draft[:12]} "
                        f"vs {served_draft[:12]}): re-run `dvc repro` so that both measure paths.draft")
    empty = served.get("empty_suites") or {}
    rows = {}
    for suite in require(engine, ["suites"], eval_json):
        row = {key: number(engine, ["suites", suite, source], eval_json, digits) for key, source in ENGINE_KEYS.items()}
        for key, source in SERVED_KEYS.items():
            served_at = ["suites", suite, SERVED_LEVEL, source]
            row[key] = None if suite in empty else number(served, served_at, serve_json, digits)
        rows[suite] = row
    return rows


def read_json(path: Path) -> dict[str, Any]:
    """A metrics file -> its JSON object; UserError naming the file when it is missing or not an object."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such metrics file (run `dvc repro`)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read it as JSON: {err}") from None
    if not isinstance(document, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(document).__name__}")
    return document


def require(document: dict[str, Any], keys: list[str], path: Path) -> Any:
    """document[k0][k1]... ; UserError naming the dotted key and the file when a step is missing."""
    value: Any = document
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise UserError(f"{path}: no key {'.'.join(keys[:i + 1])!r} (written by an older or another stage? "
                            "re-run `dvc repro`)")
        value = value[key]
    return value


def number(document: dict[str, Any], keys: list[str], path: Path, digits: int) -> Optional[float]:
    """A metric -> rounded float; null stays None (a metric the run could not measure); UserError naming the
    key and the file when it is missing or not a number."""
    value = require(document, keys, path)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{path}: {'.'.join(keys)!r} must be a number, got {value!r}")
    return round(float(value), digits)
