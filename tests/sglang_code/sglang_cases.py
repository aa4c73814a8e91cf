"""The exports the SGLang-code tests load: tiny ones made by our exporter, copies broken on purpose
(with SGLang's verdict on each), the real `artifacts/draft`; where SGLang's code is installed.

The folder is not called tests/sglang: pytest puts tests/ on the import path, where a folder named
sglang would be found as the `sglang` namespace package (`find_spec("sglang")` in serve/sglang.py)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
from export_helpers import edit_config, edit_tensors, save_checkpoint  # noqa: E402

TINY_TARGET = {"name": "tiny-target", "sha256": "0" * 64}
ROPE_THETA = 12345.0  # neither SGLang's nor transformers' default: a theta read from the wrong key shows
ROLLOUT = {"seed": 1234, "blocks": 24}


def sglang_version() -> str:
    """The tested SGLang version: the one pin of pyproject's `serve` extra."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'^serve = \["sglang==([^"]+)"\]', text, re.M)
    assert match, "pyproject.toml: the serve extra must pin sglang==<version>"
    return match.group(1)


def sglang_site() -> Path:
    """Where `make sglang-ref` installs SGLang's code (override: DOMINOSPEC_SGLANG_SITE)."""
    return Path(os.environ.get("DOMINOSPEC_SGLANG_SITE", REPO / ".venv" / f"sglang-{sglang_version()}"))


def real_draft() -> Path:
    """The pipeline's export, params.yaml's paths.draft; DOMINOSPEC_SGLANG_DRAFT names another export dir."""
    override = os.environ.get("DOMINOSPEC_SGLANG_DRAFT")
    return Path(override) if override else REPO / yaml.safe_load((REPO / "params.yaml").read_text())["paths"]["draft"]


def export_tiny(directory: Path, seed: int, **overrides) -> Path:
    """A random tiny checkpoint through our exporter's own steps -> the export directory."""
    from dominospec.export.checkpoint import read_checkpoint
    from dominospec.export.hf import export_config, export_tensors, write_draft_dir

    trained = read_checkpoint(save_checkpoint(directory.with_name(directory.name + "-checkpoint"), TINY_TARGET,
                                              seed=seed, rope_theta=ROPE_THETA, **overrides))
    exported = export_config(trained.config)
    write_draft_dir(directory, exported, export_tensors(trained.tensors, exported))
    return directory


def _to_dflash(config: dict) -> None:
    """Plain-DFlash config, head tensors kept."""
    config.pop("emb_dim")
    config["dflash_config"] = {key: config["dflash_config"][key] for key in ("mask_token_id", "target_layer_ids")}


# Exports broken on purpose: name -> (edit of a copy of the tiny Domino export, SGLang 0.5.23's
# verdict: None = loads it without a word, else a pattern of its error). Our check_export_dir must
# name each one (test_sglang_code.py: BROKEN_PROBLEMS).
BROKEN = {
    "missing_backbone_tensor": (lambda d: edit_tensors(d, lambda t: t.pop("layers.1.mlp.down_proj.weight")), None),
    "extra_lm_head": (lambda d: edit_tensors(d, lambda t: t.update({"lm_head.weight": torch.zeros(300, 32, dtype=torch.bfloat16)})), None),
    "extra_embed_tokens": (lambda d: edit_tensors(d, lambda t: t.update({"embed_tokens.weight": torch.zeros(300, 32, dtype=torch.bfloat16)})), None),
    "f32_tensors": (lambda d: edit_tensors(d, lambda t: t.update({k: v.float() for k, v in t.items()})), None),
    "shift_label_false": (lambda d: edit_config(d, lambda c: c["dflash_config"].update(shift_label=False)), None),
    "attention_bias_true": (lambda d: edit_config(d, lambda c: c.update(attention_bias=True)), None),
    "use_gemma_norm": (lambda d: edit_config(d, lambda c: c.update(use_gemma_norm=True)), None),
    "hidden_act_gelu": (lambda d: edit_config(d, lambda c: c.update(hidden_act="gelu")),
                        r"^init: ValueError: Unsupported DFlash activation: gelu"),
    "missing_head_tensor": (lambda d: edit_tensors(d, lambda t: t.pop("embed_proj.2.weight")),
                            r"^load: ValueError: DFLASH Domino checkpoint is missing required projector weights"),
    "head_without_projector": (lambda d: edit_config(d, _to_dflash),
                               r"^load: ValueError: DFLASH checkpoint contains Domino projector weights"),
    "emb_dim_mismatch": (lambda d: edit_config(d, lambda c: c.update(emb_dim=16)),
                         r"^config: ValueError: DFLASH Domino emb_dim differs"),
    "pure_draft_prefix_len_2": (lambda d: edit_config(d, lambda c: c["dflash_config"].update(pure_draft_prefix_len=2)),
                                r"^config: ValueError: DFLASH Domino currently requires pure_draft_prefix_len=1"),
    "fc_shape": (lambda d: edit_config(d, lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 3])),
                 r"^load: ValueError: DFLASH fc.weight shape mismatch"),
}
