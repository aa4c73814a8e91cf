"""A tiny trained-looking draft saved as `checkpoints/final`, a tiny target, and a params file for them.

Sizes are pairwise distinct where they meet in a weight (q 48, kv 24, ffn 40, H 32, G 20, r 8, V 300),
so a transposed or swapped tensor shows up as a wrong shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
from cache_helpers import save_tiny_target, target_params  # noqa: E402

BLOCK, LAYER_IDS, MASK = 4, [1, 3], 299


def draft_kwargs(identity: dict, **overrides) -> dict:
    """DominoDraftConfig keyword arguments of the tiny draft for the tiny Llama target (6 layers, H 32, V 300)."""
    kwargs = dict(
        vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024,
        block_size=BLOCK, num_target_layers=6, emb_dim=8, use_domino_head=True, target=identity,
        dflash_config=dict(mask_token_id=MASK, target_layer_ids=LAYER_IDS, projector_type="domino",
                           pure_draft_prefix_len=1, emb_dim=8, gru_hidden_dim=20, shift_label=True),
    )
    kwargs.update(overrides)
    return kwargs


def save_checkpoint(directory: Path, identity: dict, seed: int = 0, **overrides) -> Path:
    """Random fp32 draft (weights ~N(0, 0.3), visible head) -> `save_pretrained(directory)`."""
    from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig

    torch.manual_seed(seed)
    draft = DFlashDraftModel(DominoDraftConfig(**draft_kwargs(identity, **overrides)))
    with torch.no_grad():
        for p in draft.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
            else:  # norms away from 1, so a dropped norm weight changes the outputs
                p.uniform_(0.5, 1.5)
    draft.save_pretrained(directory, safe_serialization=True)
    return directory


def write_export_params(path: Path, target_dir: Path, root: Path, **draft) -> Path:
    """The repo's params.yaml with artefacts under `root`, the tiny target and the tiny draft's sections."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["paths"] = {key: str(root / Path(value).name) for key, value in raw["paths"].items()}
    raw["paths"]["checkpoints"] = str(root / "checkpoints")
    raw["target"].update(model=str(target_dir), gguf_file=None, device="cpu", dtype="float32", mask_token_id=None)
    raw["draft"].update(dict(num_layers=2, block_size=BLOCK, intermediate_size=40, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=12, gru_hidden_dim=20, emb_dim=8, use_domino_head=True),
                        **draft)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def write_metrics(metrics: Path) -> None:
    """Small stand-ins for the upstream stages' metrics files."""
    metrics.mkdir(parents=True, exist_ok=True)
    (metrics / "prepare.json").write_text(json.dumps({"conversations_read": 17, "skipped": {"empty": 2}}))
    (metrics / "cache.json").write_text(json.dumps({"tokens": 4321, "dtype": "bfloat16"}))
    (metrics / "train.json").write_text(json.dumps({"val_acceptance_length": 2.3456, "steps": 6}))


def make_project(root: Path, target_dir: Path, identity: dict, seed: int = 0, draft_params: dict | None = None,
                 **config_overrides) -> Path:
    """root/{params.yaml, checkpoints/final, metrics/*.json} for the tiny target -> the params path."""
    root.mkdir(parents=True, exist_ok=True)
    params = write_export_params(root / "params.yaml", target_dir, root, **(draft_params or {}))
    save_checkpoint(root / "checkpoints" / "final", identity, seed=seed, **config_overrides)
    write_metrics(root / "metrics")
    return params


__all__ = ["save_tiny_target", "target_params", "make_project", "save_checkpoint", "draft_kwargs",
           "write_export_params", "BLOCK", "LAYER_IDS", "MASK"]


def edit_config(directory: Path, edit) -> None:
    """Apply `edit` (dict -> None) to an export's config.json in place (negative cases)."""
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def edit_tensors(directory: Path, edit) -> None:
    """Apply `edit` (name -> tensor dict -> None) to an export's model.safetensors in place."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")
