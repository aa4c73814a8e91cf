"""The SGLang command line that serves an exported draft as DFLASH (+ Domino head): pure, no SGLang needed.

`sglang_command(params, host, port) -> argv` builds

    python -m sglang.launch_server --model-path <target> --speculative-algorithm DFLASH
        --speculative-draft-model-path <paths.draft> --speculative-num-draft-tokens <B>
        --host H --port N [--revision R] [--trust-remote-code] --dtype <target.dtype>
        [--served-model-name S] [--api-key K] <serve.sglang_args...>

B, the verify window SGLang drafts for, is the draft's `block_size` (config.json): SGLang's
`--speculative-num-draft-tokens` counts the anchor/bonus slot, so Domino proposes B-1 tokens per
round, the built-in engine's default K. Whether the head is used is the draft's own choice
(`dflash_config.projector_type: domino`), not a flag.

SGLang needs a Hugging Face target (hub id or local directory): its DFLASH/Domino runtime runs on
the target's bf16 embedding table and LM head, which a GGUF file (quantized, e.g. Q4_1) does not
hold, so GGUF targets (the embedded default) are refused; they are served by the built-in server.

Two users: the draft's model card prints the line (dominospec.card: `launch_argv` on the exported
config.json), and `dominospec serve` executes it (dominospec.serve.sglang). It lives with export, below
both, so that the card shows exactly what `make serve` runs without the card importing serve.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from dominospec.config import Params, TargetParams
from dominospec.errors import UserError
from dominospec.target import resolve_source

MODULE = "sglang.launch_server"
ALGORITHM = "DFLASH"  # Domino is a projector sub-mode of DFLASH in SGLang >= 0.5.20


def read_draft_config(draft_dir: str | Path) -> dict:
    """Exported draft directory -> its config.json; UserError naming paths.draft when there is none."""
    config_file = Path(draft_dir) / "config.json"
    if not config_file.is_file():
        raise UserError(f"paths.draft: no exported draft at {draft_dir} (config.json missing): run `dvc repro export`")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"paths.draft: {config_file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise UserError(f"paths.draft: {config_file} is not a JSON object: re-run `dvc repro export`")
    return config


def draft_block_size(config: dict) -> int:
    """Exported config.json -> block_size (top level, or inside dflash_config)."""
    block_size = config.get("block_size", (config.get("dflash_config") or {}).get("block_size"))
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise UserError(f"paths.draft: config.json has no block_size >= 2 (got {block_size!r}): re-run `dvc repro export`")
    return block_size


def hf_target(target: TargetParams) -> bool:
    """Whether SGLang can load the target: an HF checkpoint (hub id or local directory), not a GGUF file."""
    return resolve_source(target)[1] is None


def sglang_target(params: Params) -> str:
    """params.target -> what SGLang's --model-path takes (hub id or local HF directory); UserError for GGUF."""
    source, gguf_file, _ = resolve_source(params.target)
    if gguf_file is not None:
        raise UserError(
            f"target.model: {params.target.model} ({gguf_file}) is a GGUF target; SGLang's DFLASH/Domino runtime "
            "needs an HF checkpoint (its bf16 embedding and LM head), so serve it with `--backend builtin`, or point "
            "target.model at the HF model (hub id or local directory) the draft was trained for"
        )
    return source


def sglang_command(params: Params, host: str, port: int, api_key: Optional[str] = None) -> list[str]:
    """Params + address (+ bearer key) -> the argv that launches SGLang on the exported draft."""
    sglang_target(params)  # a target SGLang cannot load is refused before the draft is looked for
    return launch_argv(params, read_draft_config(params.paths.draft), host, port, api_key)


def launch_argv(params: Params, draft_config: dict, host: str, port: int, api_key: Optional[str] = None) -> list[str]:
    """Params + the draft's exported config.json + address -> SGLang's argv (UserError when SGLang cannot serve it)."""
    target = params.target
    model_path = sglang_target(params)
    block_size = draft_block_size(draft_config)
    if (draft_config.get("dflash_config") or {}).get("projector_type") and target.dtype != "bfloat16":
        raise UserError(f"target.dtype: SGLang's Domino runtime needs bfloat16, got {target.dtype}")
    argv = [
        sys.executable, "-m", MODULE,
        "--model-path", model_path,
        "--speculative-algorithm", ALGORITHM,
        "--speculative-draft-model-path", params.paths.draft,
        "--speculative-num-draft-tokens", str(block_size),
        "--host", host,
        "--port", str(port),
    ]
    if target.revision:
        argv += ["--revision", target.revision]
    if target.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += ["--dtype", target.dtype]
    if params.serve.served_model_name:
        argv += ["--served-model-name", params.serve.served_model_name]
    if api_key:
        argv += ["--api-key", api_key]
    return argv + list(params.serve.sglang_args)


def printable(argv: list[str]) -> str:
    """argv -> one shell-like line with the --api-key value masked."""
    shown = ["***" if i > 0 and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    return " ".join(shown)
