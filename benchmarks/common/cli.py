"""The command line and loading the benchmark scripts share: `parser` (--params, --threads, --prompts,
--new-tokens), `setup`, `load_target` (params.target, or its weights from a GGUF / model folder),
`load_draft` (a trained draft, or the default architecture with random weights: `new_draft`,
`random_draft`), `suites` (params' evaluation prompts), `params_with` / `apply_sets` (SECTION.KEY=VALUE
overrides of a params file), `plain_engine` (the engine params a script overrides what it measures in).

Imports the library inside its functions, so a script's `--help` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

# The plain engine: a chain, no pool, no lookups, torch ops, dynamic caches. Every other knob is the
# params file's (the one set of defaults); a script or test overrides what it measures.
PLAIN_ENGINE = dict(linear="torch", draft_dtype=None, candidate_pool=0, confidence_cut=0.0, ngram_assist=False,
                    ngram_fork=False, head_kernel="torch", cuda_graphs="off", lean_target="off")


def plain_engine(engine: Any, tree: Optional[dict[str, Any]] = None, **overrides: Any) -> Any:
    """params.engine (config.EngineParams) -> the plain engine's params with `overrides`, and `tree`'s
    changes to engine.tree over the plain chain (e.g. `tree=dict(shape="best_first", nodes=8)`)."""
    plain = dataclasses.replace(engine, **{**PLAIN_ENGINE, **overrides})
    return plain.with_tree(**{"shape": "chain", **(tree or {})})


def parser(doc: str, params: Optional[str] = "params.yaml", threads: Optional[int] = None,
           prompts: Optional[int] = None, new_tokens: Optional[int] = None) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first line of `doc`, with the options most scripts share,
    each given its default here (None: the option is left out): --params, --threads (torch's CPU
    threads), --prompts (prompts per suite), --new-tokens."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if params is not None:
        p.add_argument("--params", default=params)
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch's CPU threads")
    if prompts is not None:
        p.add_argument("--prompts", type=int, default=prompts, help="prompts per suite")
    if new_tokens is not None:
        p.add_argument("--new-tokens", type=int, default=new_tokens)
    return p


def setup(args: argparse.Namespace) -> Any:
    """Parsed arguments -> Params of --params; torch's CPU threads set to --threads where the command has it."""
    from dominospec.config import load_params

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return load_params(args.params)


def load_target(params: Any, model_dir: Optional[str] = None, dtype: Optional[str] = None,
                device: Optional[torch.device] = None) -> Any:
    """params.target loaded; with `model_dir` its weights come from that folder (one holding
    target.gguf_file, or an HF model dir) on the best device there is; `dtype` overrides target.dtype."""
    from dominospec.target import load_target as load

    changes: dict[str, Any] = {}
    if model_dir:
        changes.update(model=str(model_dir), device="auto")
    if dtype:
        changes["dtype"] = dtype
    return load(dataclasses.replace(params.target, **changes), device=device)


def load_draft(params: Any, target: Any, path: Optional[str] = None, random: bool = False) -> Any:
    """The draft a script measures: `random_draft` when `random`, else the trained draft at `path`
    (default: the pipeline's, engine.draft_dir: the export, else checkpoints/final)."""
    from dominospec.draft import draft_dir
    from dominospec.draft import load_draft as load

    if random:
        return random_draft(params, target)
    return load(path or draft_dir(params.paths), target)


def new_draft(params: Any, target: Any, draft_params: Any = None) -> Any:
    """The draft architecture of params `draft:` (or `draft_params`) for `target`, freshly initialised
    (seed 0, fp32, trainable), on the feature layers of params `cache:`."""
    from dominospec.cache.features import resolve_layer_ids
    from dominospec.models.domino import DFlashDraftModel
    from dominospec.train.build import draft_config

    layer_ids = resolve_layer_ids(params.cache, target.num_layers)
    torch.manual_seed(0)
    return DFlashDraftModel(draft_config(draft_params or params.draft, target, layer_ids, mask_token_id=16))


def random_draft(params: Any, target: Any) -> Any:
    """The default draft architecture (params `draft:`) with random weights, in the target's dtype, frozen:
    a round's *cost* does not depend on draft quality (τ ≈ 1 then)."""
    draft = new_draft(params, target)
    return draft.to(target.embed_tokens.weight.dtype).eval().requires_grad_(False)


def suites(params: Any, tokenizer: Any, prompts: int, specs: Optional[list[str]] = None,
           max_prompt_tokens: Optional[int] = None) -> Iterator[Any]:
    """The evaluation's suites (params evaluate.suites, or `specs`) -> eval.prompts.Suite each, of at most
    `prompts` prompts of at most `max_prompt_tokens` (default evaluate.max_prompt_tokens) tokens."""
    from dominospec.eval.prompts import load_suite

    for spec in specs or params.evaluate.suites:
        yield load_suite(spec, tokenizer, params.target.chat_template_kwargs, params.paths.prepared, prompts,
                         max_prompt_tokens or params.evaluate.max_prompt_tokens)


def apply_sets(raw: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """SECTION.KEY=VALUE items (a dotted key of any depth, e.g. engine.tree.nodes; VALUE read as YAML) -> raw
    params, in place (and returned); an unknown key stops."""
    import yaml

    for item in sets:
        key, _, value = item.partition("=")
        *path, name = key.split(".")
        table = raw
        for part in path:
            table = table.get(part) if isinstance(table, dict) else None
        if not path or not isinstance(table, dict) or name not in table:
            raise SystemExit(f"--set {item}: no params key {key}")
        table[name] = yaml.safe_load(value)
    return raw


def params_with(path: str | Path, sets: list[str]) -> Any:
    """A params file with SECTION.KEY=VALUE overrides -> Params, checked by the loader (through a temporary file)."""
    import yaml

    from dominospec.config import load_params, read_params

    raw = apply_sets(read_params(path), sets)
    with tempfile.TemporaryDirectory() as tmp:
        changed = Path(tmp) / Path(path).name
        changed.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        return load_params(changed)
