"""Reading the train stage's output `<paths.checkpoints>/final/` and refusing one that cannot be exported.

The directory is `save_pretrained` of the trained inner model: config.json + model.safetensors
(or shards + index), in the training dtype. Every tensor the config implies must be there with
its shape: `from_pretrained` would silently re-initialise a missing one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dominospec.errors import UserError
from dominospec.config import DraftParams
from dominospec.export.contract import CONFIG_FILE, HEAD_TENSORS, WEIGHTS_FILE, expected_tensors, tensor_problems
from dominospec.models.domino import DominoDraftConfig


@dataclass
class TrainedDraft:
    """A checked checkpoint: its config and its tensors as saved (training dtype)."""

    path: Path
    config: DominoDraftConfig
    tensors: dict[str, torch.Tensor]


def read_checkpoint(path: Path) -> TrainedDraft:
    """Checkpoint directory -> TrainedDraft; UserError naming the path and the problem otherwise."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise UserError(f"no trained draft at {path} ({CONFIG_FILE} missing): run the train stage first")
    try:
        config = DominoDraftConfig.from_pretrained(path)
    except (ValueError, TypeError, OSError) as err:  # the config class validates the Domino invariants
        raise UserError(f"{path / CONFIG_FILE}: {err}") from err
    tensors = _read_tensors(path)
    config_dict = config.to_dict()
    expected = expected_tensors(config_dict, head=True)
    found = {name: (tuple(t.shape), str(t.dtype)) for name, t in tensors.items()}
    problems = tensor_problems(expected, found, dtype=None)
    if not config.use_domino_head:  # a head-off draft may come without (unused) head tensors
        missing_head = {f"tensor {name} is missing" for name in HEAD_TENSORS}
        problems = [p for p in problems if p not in missing_head]
    if problems:
        raise UserError(f"the checkpoint at {path} does not match its {CONFIG_FILE}: " + "; ".join(problems))
    return TrainedDraft(path=path, config=config, tensors=tensors)


def check_matches_params(config: DominoDraftConfig, draft: DraftParams, path: Path) -> None:
    """Raise UserError when the checkpoint was trained with other `draft` params than params.yaml's."""
    pairs = {
        "num_layers": (config.num_hidden_layers, draft.num_layers),
        "block_size": (config.block_size, draft.block_size),
        "gru_hidden_dim": (config.gru_hidden_dim, draft.gru_hidden_dim),
        "emb_dim": (config.emb_dim, draft.emb_dim),
        "use_domino_head": (config.use_domino_head, draft.use_domino_head),
        "intermediate_size": (config.intermediate_size, draft.intermediate_size),
        "num_attention_heads": (config.num_attention_heads, draft.num_attention_heads),
        "num_key_value_heads": (config.num_key_value_heads, draft.num_key_value_heads),
        "head_dim": (config.head_dim, draft.head_dim),
    }
    stale = [f"draft.{key} is {want} in params but {got} in the checkpoint"
             for key, (got, want) in pairs.items() if want is not None and got != want]
    if stale:
        raise UserError(f"the checkpoint at {path} was trained with other draft params: " + "; ".join(stale)
                        + " (re-run the train stage)")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed in model.safetensors.index.json -> {name: tensor}."""
    single, index = path / WEIGHTS_FILE, path / f"{WEIGHTS_FILE}.index.json"
    try:
        if single.is_file():
            return load_file(single)
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                tensors.update(load_file(path / shard))
            return tensors
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise UserError(f"cannot read the checkpoint weights in {path}: {err}") from err
    raise UserError(f"no weights in {path}: expected {WEIGHTS_FILE} (or its shards + index)")
