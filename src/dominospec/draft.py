"""Finding and loading a trained draft for a loaded target, refusing one made for another target.

`draft_dir` prefers the export dir `paths.draft` (bf16, what SGLang serves) to the training output
`paths.checkpoints/final`; both are Hugging Face layouts (config.json + model.safetensors). The weights
are cast to the target's dtype and device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dominospec.errors import UserError
from dominospec.config import Paths
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.target import Target

ARCHITECTURES = ("DFlashDraftModel", "DominoDraftModel")  # SGLang / SpecForge names of the same model


def draft_dir(paths: Paths) -> Path:
    """Paths -> the export dir when it holds a draft, else the training output `checkpoints/final`."""
    exported = Path(paths.draft)
    if (exported / "config.json").is_file():
        return exported
    return Path(paths.checkpoints) / "final"


def check_draft_matches(config: DominoDraftConfig, target: Target) -> None:
    """Raise UserError naming the first mismatch between a draft config and the loaded target."""
    identity = target.identity
    problems = []
    if config.vocab_size != identity.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != target's {identity.vocab_size}")
    if config.hidden_size != identity.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != target's {identity.hidden_size}")
    if config.num_target_layers != identity.num_layers:
        problems.append(f"num_target_layers {config.num_target_layers} != target's {identity.num_layers}")
    ids = config.target_layer_ids
    if not ids or min(ids) < 0 or max(ids) > identity.num_layers - 2:
        problems.append(f"target_layer_ids {ids} out of range 0..{identity.num_layers - 2}")
    mask = config.mask_token_id
    if mask is None or not 0 <= mask < identity.vocab_size:
        problems.append(f"mask_token_id {mask} is not a token of the target")
    recorded: Any = config.target
    if recorded is not None and not identity.same_model(recorded):
        problems.append(
            f"it was trained for target {recorded.get('name')!r} ({recorded.get('sha256') or recorded.get('revision')}), "
            f"not {identity.name!r} ({identity.sha256 or identity.revision})"
        )
    if problems:
        raise UserError("the draft does not fit the loaded target: " + "; ".join(problems))


def load_draft(path: str | Path, target: Target) -> DFlashDraftModel:
    """Draft directory (checkpoint or export) -> DFlashDraftModel in the target's dtype, on its device, eval."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"no draft at {path} (config.json missing): run the train stage first")
    config = DominoDraftConfig.from_pretrained(path)
    architectures = config.architectures or []
    if not any(a in ARCHITECTURES for a in architectures):
        raise UserError(f"{path}/config.json: architectures {architectures} is not one of {list(ARCHITECTURES)}")
    check_draft_matches(config, target)
    try:
        draft = DFlashDraftModel.from_pretrained(path, config=config, use_safetensors=True)  # never a pickled .bin
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"cannot load the draft weights in {path}: {err}") from err
    dtype = target.embed_tokens.weight.dtype
    return draft.to(device=target.device, dtype=dtype).eval().requires_grad_(False)
