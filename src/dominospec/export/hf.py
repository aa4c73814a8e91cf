"""The Hugging Face draft directory SGLang serves: config.json in the contract's profile and bf16 weights.

`export_config` turns the checkpoint's config into the exported config.json (everything
transformers writes, normalised to the contract); `export_tensors` keeps exactly the contract's
tensors, cast to bf16; `write_draft_dir` writes both and returns the weights' sha256.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dominospec.files import sha256_file
from dominospec.export.contract import (
    ARCHITECTURES, CONFIG_FILE, DFLASH_KEYS, DOMINO, DOMINO_FIXED, DOMINO_SHAPE_KEYS, DTYPE, FORMAT_VERSION,
    MODEL_TYPE, WEIGHTS_FILE, expected_tensors, profile,
)
from dominospec.models.domino import DominoDraftConfig


def export_config(config: DominoDraftConfig) -> dict[str, Any]:
    """Checkpoint config -> exported config.json dict: Domino profile with the head on, plain DFlash without."""
    out = config.to_diff_dict()  # what save_pretrained writes to config.json
    for key in ("auto_map", "_name_or_path", "transformers_version"):
        out.pop(key, None)
    theta = float(config.rope_theta)
    out.update(
        architectures=list(ARCHITECTURES),
        model_type=MODEL_TYPE,
        dtype=DTYPE,
        torch_dtype=DTYPE,
        tie_word_embeddings=False,
        rope_theta=theta,  # the plain field SGLang and transformers 4.x read
        rope_parameters={"rope_type": "default", "rope_theta": theta},  # what transformers 5.x writes
        export_format_version=FORMAT_VERSION,
    )
    dflash = config.dflash_config
    if config.use_domino_head:
        # Copied, not forced: a checkpoint off the contract (e.g. pure_draft_prefix_len 2) must fail the check.
        out["dflash_config"] = {key: dflash[key] for key in DFLASH_KEYS + DOMINO_SHAPE_KEYS + tuple(DOMINO_FIXED)}
        out["emb_dim"] = dflash["emb_dim"]  # SGLang reads the top-level copy, HF code the nested one
    else:
        out["dflash_config"] = {key: dflash[key] for key in DFLASH_KEYS}
        out.pop("emb_dim", None)
    return out


def export_tensors(tensors: dict[str, torch.Tensor], exported_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> exactly the contract's tensors for `exported_config`, bf16, contiguous."""
    names = expected_tensors(exported_config, head=profile(exported_config) == DOMINO)
    return {name: tensors[name].detach().to(torch.bfloat16).contiguous() for name in names}


def write_draft_dir(directory: Path, exported_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """Write config.json and model.safetensors into `directory` (created) -> sha256 of the weights file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(exported_config, indent=2, sort_keys=True) + "\n")
    weights = directory / WEIGHTS_FILE
    save_file({name: t.cpu() for name, t in tensors.items()}, weights, metadata={"format": "pt"})
    # safetensors creates 0600; a served model must be as readable as its config (umask applied)
    weights.chmod((directory / CONFIG_FILE).stat().st_mode & 0o777)
    return sha256_file(weights)
