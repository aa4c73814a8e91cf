"""The `export` stage: trained checkpoint -> the draft SGLang serves, and its ONNX graphs.

Reads   <paths.checkpoints>/final/   the trained inner model (`save_pretrained`, training dtype)
        the target                   its identity must be the one the draft was trained for;
                                     its LM head goes into the ONNX block graph
Writes  paths.draft/                 config.json + bf16 model.safetensors (contract.py), nothing else
        paths.onnx, paths.onnx_rollout   fp32 block forward and rollout step (onnx_graphs.py)

The directory is replaced whole, so a model card of earlier weights goes with them: the `card` stage
(dominospec.card) writes paths.draft/README.md after evaluate, quoting the evaluation of these weights.

Head-on drafts export in the Domino profile, head-off drafts (draft.use_domino_head: false) as plain
DFlash. Nothing is replaced until every output is written and checked.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dominospec.errors import UserError
from dominospec.config import Params
from dominospec.draft import check_draft_matches
from dominospec.export.checkpoint import check_matches_params, read_checkpoint
from dominospec.export.contract import HEAD_TENSORS, check_config, check_export_dir, profile
from dominospec.export.hf import export_config, export_tensors, write_draft_dir
from dominospec.export.onnx_graphs import MIN_OPSET, export_onnx
from dominospec.export.staging import Staging
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.target import load_target


def export(params: Params) -> None:
    """Params -> paths.draft (HF directory for SGLang), paths.onnx and paths.onnx_rollout."""
    if params.export.onnx_opset < MIN_OPSET:
        raise UserError(f"export.onnx_opset must be >= {MIN_OPSET}, got {params.export.onnx_opset}")
    checkpoint = Path(params.paths.checkpoints) / "final"
    trained = read_checkpoint(checkpoint)
    check_matches_params(trained.config, params.draft, checkpoint)
    exported = export_config(trained.config)
    problems = check_config(exported)
    if problems:
        raise UserError(f"the checkpoint at {checkpoint} cannot be exported for SGLang: " + "; ".join(problems))
    target = load_target(params.target, device=torch.device("cpu"))
    check_draft_matches(trained.config, target)
    tensors = export_tensors(trained.tensors, exported)

    with Staging() as staging:
        draft_dir = staging.path_for(Path(params.paths.draft))
        weights_sha256 = write_draft_dir(draft_dir, exported, tensors)
        problems = check_export_dir(draft_dir)
        if problems:  # a bug in the writer, not the user's doing
            raise RuntimeError("the export breaks its own contract: " + "; ".join(problems))
        export_onnx(
            exported_draft(trained.config, tensors),
            target.lm_head.weight,
            staging.path_for(Path(params.paths.onnx)),
            staging.path_for(Path(params.paths.onnx_rollout)),
            params.export.onnx_opset,
        )
        staging.publish()
    print(f"export: {params.paths.draft} ({profile(exported)}, {len(tensors)} bf16 tensors, sha256 "
          f"{weights_sha256[:12]}), {params.paths.onnx}, {params.paths.onnx_rollout}; its model card comes after "
          "evaluation (`dominospec card`)")


def exported_draft(config: DominoDraftConfig, tensors: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """Checkpoint config + exported bf16 tensors -> the same draft in fp32, eval mode (a head-off
    draft keeps its unused head modules freshly initialised)."""
    draft = DFlashDraftModel(config)
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    allowed = set() if config.use_domino_head else set(HEAD_TENSORS)
    if unexpected or set(missing) - allowed:
        raise RuntimeError(f"exported tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    return draft.float().eval().requires_grad_(False)
