"""The model card's text: the exported draft's README.md, from its config.json, params and this run's metrics.

`model_card(params, exported, weights_sha256, measured) -> str`, in this order: the front matter
(base_model, tags, card.license), what the draft is, the results of this run's evaluation (headline.json,
then eval.json's modes and serve_eval.json's levels), the target, the draft's shapes, the data
(prepare.json, cache.json), training (draft and train params, train.json), serving (the SGLang launch
`make serve` runs, and the built-in server) and the ONNX graphs.

`measured` carries each evaluation document only when it describes these weights (card.stage decides);
for one that does not, it carries the sentence saying why, which the card prints in place of numbers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from dominospec.config import Params
from dominospec.eval.headline import ENGINE_KEYS, SERVED_KEYS
from dominospec.export.contract import DOMINO, FORMAT_VERSION, profile

MAX_LIST = 32  # longer lists are summarised by their length
Quoted = Union[dict[str, Any], str]  # a document that describes these weights, or why it is not quoted
HEADLINE_TITLES = {"tau": "τ", "speedup_vs_ar": "× autoregressive", "speedup_vs_ngram": "× prompt lookup",
                   "exact_match": "exact match", "served_tau": "served τ (c = 1)",
                   "served_tokens_per_s": "served tokens/s (c = 1)"}


@dataclass(frozen=True)
class Measured:
    """This run's evaluation of the carded weights: per document its JSON object, or why it is not quoted."""

    headline: Quoted  # headline.json
    engine: Quoted  # eval.json
    served: Quoted  # serve_eval.json


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


def model_card(params: Params, exported: dict[str, Any], weights_sha256: str, measured: Measured) -> str:
    """Params + exported config.json + weights hash + this run's evaluation -> README.md text."""
    metrics = Path(params.paths.metrics)
    target, dflash = exported["target"], exported["dflash_config"]
    domino = profile(exported) == DOMINO
    kind = "Domino (DFlash backbone + GRU logit correction)" if domino else "DFlash (block-parallel, no Domino head)"
    block = exported["block_size"]
    launch = sglang_lines(params, exported)
    license_line = [f"license: {json.dumps(params.card.license)}"] if params.card.license else []
    lines = [
        "---",
        f"base_model: {json.dumps(target['name'])}",
        *license_line,
        "tags: [speculative-decoding, dflash" + (", domino" if domino else "") + ", sglang]",
        "---",
        "",
        f"# {kind} draft for `{target['name']}`",
        "",
        f"A speculative-decoding draft: it proposes {block - 1} tokens per target verification "
        f"(block size {block}); the target's output is unchanged. Weights are bf16, without embedding "
        f"or LM head (both are the target's). Export format {FORMAT_VERSION}, weights sha256 `{weights_sha256}`.",
        "",
        *results_lines(measured, metrics),
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
        "## Training",
        "",
        "```yaml",
        yaml.safe_dump({"draft": dataclasses.asdict(params.draft), "train": dataclasses.asdict(params.train)},
                       sort_keys=False).rstrip(),
        "```",
        "",
        *_metrics_section(metrics / "train.json"),
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


def results_lines(measured: Measured, metrics: Path) -> list[str]:
    """This run's evaluation -> the card's Results section: headline, engine modes, served levels (or why not)."""
    lines = ["## Results", ""]
    if isinstance(measured.headline, str):
        lines += [measured.headline, ""]
    else:
        keys = [*ENGINE_KEYS, *SERVED_KEYS]
        lines += [f"From `{metrics / 'headline.json'}`, measured on these weights by this pipeline's evaluate and "
                  "serve_eval stages:", "",
                  "| suite | " + " | ".join(HEADLINE_TITLES[k] for k in keys) + " |",
                  "|---" * (len(keys) + 1) + "|",
                  *(f"| {suite} | " + " | ".join(_format(row.get(k)) for k in keys) + " |"
                    for suite, row in measured.headline.items()), ""]
    lines += [f"### The engine (`{metrics / 'eval.json'}`)", ""]
    lines += [measured.engine, ""] if isinstance(measured.engine, str) else engine_lines(measured.engine)
    lines += [f"### Served (`{metrics / 'serve_eval.json'}`)", ""]
    lines += [measured.served, ""] if isinstance(measured.served, str) else served_lines(measured.served)
    return lines


def engine_lines(report: dict[str, Any]) -> list[str]:
    """eval.json -> its conditions in a sentence, then per suite a table of the modes (τ, tokens/s, speed-up, exact)."""
    versions = ", ".join(f"{name} {version}" for name, version in (report.get("versions") or {}).items())
    lines = [f"Every mode decoded the same prompts, interleaved prompt by prompt: `{report.get('spec_mode')}` is "
             f"the draft's own mode. Temperature {_format(report.get('temperature'))}, "
             f"{_format(report.get('max_new_tokens'))} new tokens a prompt, block size {_format(report.get('block_size'))}, "
             f"drafts per round {_format(report.get('num_draft_setting'))} (at most {_format(report.get('num_draft'))}); "
             f"the target in {report.get('dtype')} on {report.get('device_name')} ({report.get('device')}), {versions}. "
             "τ is tokens per target verification, pooled, ± its standard error over prompts.", ""]
    for suite, doc in report.get("suites", {}).items():
        lines += [f"{suite} ({_format(doc.get('n_prompts'))} prompts):", "", *_modes_table(doc.get("modes", {})), ""]
        sampled = doc.get("sampled")
        if isinstance(sampled, dict) and isinstance(sampled.get("modes"), dict):
            lines += [f"{suite}, sampled at temperature {_format(report.get('sampled_temperature'))}:", "",
                      *_modes_table(sampled["modes"]), ""]
    return lines


def served_lines(report: dict[str, Any]) -> list[str]:
    """serve_eval.json -> how the server ran, then per suite and concurrency level τ, tokens/s, latency, errors."""
    lines = [f"`make serve`'s {report.get('backend')} backend (mode `{report.get('serve_mode')}`) over HTTP, "
             f"{_format(report.get('max_prompts'))} prompts a suite × {_format(report.get('max_new_tokens'))} tokens, "
             f"temperature {_format(report.get('temperature'))}, on {report.get('date')}.", "",
             "| suite | requests in flight | τ | tokens/s | latency p50 (s) | errors |", "|---|---|---|---|---|---|"]
    for suite, levels in report.get("suites", {}).items():
        for level in sorted(levels.values(), key=lambda m: m.get("concurrency", 0)):
            lines.append(f"| {suite} | " + " | ".join(_format(level.get(k)) for k in (
                "concurrency", "acceptance_length", "tokens_per_s", "latency_p50_s", "errors")) + " |")
    for suite, why in (report.get("empty_suites") or {}).items():
        lines.append(f"| {suite} | – | – | – | – | not run: {_format(why)} |")
    return [*lines, ""]


def _modes_table(modes: dict[str, Any]) -> list[str]:
    """{mode: metrics} -> a Markdown table: mode, τ ± SE, tokens/s, × autoregressive ± SE, exact match."""
    rows = ["| mode | τ | tokens/s | × autoregressive | exact match |", "|---|---|---|---|---|"]
    for mode, m in modes.items():
        rows.append(f"| {mode} | {_plus_minus(m.get('acceptance_length'), m.get('acceptance_length_se'))} | "
                    f"{_format(m.get('tokens_per_s'))} | {_plus_minus(m.get('speedup'), m.get('speedup_se'))} | "
                    f"{_format(m.get('exact_match'))} |")
    return rows


def _plus_minus(value: Any, se: Any) -> str:
    """A value and its standard error -> "v ± se", the error to two significant digits."""
    return _format(value) if not isinstance(se, float) or not se else f"{_format(value)} ± {se:.2g}"


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
