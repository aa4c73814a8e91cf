"""The pipeline's stages by name, and the entry point `pipeline/<stage>.py` runs (what dvc.yaml calls).

A stage is `fn(params: Params) -> None` in the library; `STAGES` names its module and function, so
the `dominospec <stage>` command (cli) and the DVC script run the same code, and a stage's
dependencies are the modules it imports from there (tests/test_layout.py checks dvc.yaml lists them).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, Optional, Sequence

from dominospec.config import load_params
from dominospec.errors import UserError

# stage name (= params section = pipeline script) -> "module:function" taking Params
STAGES: dict[str, str] = {
    "prepare": "dominospec.data.prepare:prepare",
    "regenerate": "dominospec.regenerate.stage:regenerate",
    "cache": "dominospec.cache.stage:cache",
    "train": "dominospec.train.stage:train",
    "export": "dominospec.export.stage:export",
    "evaluate": "dominospec.eval.stage:evaluate",
    "serve_eval": "dominospec.eval.serve_stage:serve_eval",
    "headline": "dominospec.eval.headline:headline",
    "card": "dominospec.card.stage:card",
}


def resolve(spec: str) -> Callable[..., Any]:
    module, fn = spec.split(":")
    return getattr(importlib.import_module(module), fn)


def run_stage(stage: str, params_path: str) -> None:
    """Validate the params file first (no work on bad params), then run the stage function."""
    params = load_params(params_path)
    resolve(STAGES[stage])(params)


def report_user_errors(fn: Callable[[], None]) -> int:
    """Run `fn`, turning known user-facing errors into one line on stderr and exit code 2."""
    try:
        fn()
    except UserError as err:  # ParamsError and TargetError included
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def stage_main(stage: str, argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `pipeline/<stage>.py`: parse --params, run the stage."""
    parser = argparse.ArgumentParser(prog=f"pipeline/{stage}.py", description=f"DVC stage `{stage}`")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    return report_user_errors(lambda: run_stage(stage, args.params))
