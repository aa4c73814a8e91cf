"""fp32 ONNX graphs of the draft: the block forward (`paths.onnx`) and one rollout step (`paths.onnx_rollout`).

Block forward, batch 1, block length B = block_size fixed, context length S dynamic:
  block_embeds [1, B, H] f32     target embeddings of [x_start, MASK x (B-1)]
  block_positions [1, B] i64     their absolute positions start..start+B-1
  target_features [1, S, n*H] f32  the n target layers' outputs at positions 0..S-1
  -> base_logits [1, B, V] f32   u = lm_head(z); the target's LM head is a graph initializer,
                                 so a consumer needs only the target's embedding table
     z [1, B, H] f32             the normed draft states

Rollout step (shift_label = true: slot j predicts d_{j+1}):
  z [1, H] (z_j), state [1, G] (s_{j-1}), token_embed [1, H] (E(d_j), with d_0 = x_start),
  base_logits [1, V] (u_j)
  -> new_state [1, G] (s_j), logits [1, V] = u_j + W2 . SiLU(W1 . [z_j ; s_j]), token [1] i64 (argmax)
  Driving it: s_{-1} = 0; for j = 0..B-2 run the step on (z_j, s_{j-1}, E(d_j), u_j); slot j takes
  the step's token, except slots j < pure_draft_prefix_len (= 1), which take argmax(u_j).
  A head-off draft's step passes the state through and returns u_j and its argmax.

Both graphs hold the exported weights (bf16 values, computed in fp32), so they match what SGLang
serves. A graph whose weights pass protobuf's 2 GB limit keeps them in one `<file>.data` next to it.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from dominospec.models.domino import DFlashDraftModel

BLOCK_INPUTS = ["block_embeds", "block_positions", "target_features"]
BLOCK_OUTPUTS = ["base_logits", "z"]
STEP_INPUTS = ["z", "state", "token_embed", "base_logits"]
STEP_OUTPUTS = ["new_state", "logits", "token"]
MIN_OPSET = 17


class BlockForward(nn.Module):
    """The draft's block forward with the target's LM head: (embeds, positions, features) -> (u, z)."""

    def __init__(self, draft: DFlashDraftModel, lm_head_weight: torch.Tensor):
        super().__init__()
        self.draft = draft
        self.register_buffer("lm_head_weight", lm_head_weight)  # [V, H]

    def forward(self, block_embeds, block_positions, target_features):
        """[1, B, H], [1, B], [1, S, n*H] -> base logits [1, B, V], z [1, B, H]."""
        z = self.draft(block_embeds, block_positions, target_features=target_features)
        return F.linear(z, self.lm_head_weight), z


class RolloutStep(nn.Module):
    """One Domino head step: (z_j, s_{j-1}, E(d_j), u_j) -> (s_j, u_j + correction, argmax)."""

    def __init__(self, draft: DFlashDraftModel):
        super().__init__()
        self.draft = draft

    def forward(self, z, state, token_embed, base_logits):
        """[1, H], [1, G], [1, H], [1, V] -> [1, G], [1, V], [1]."""
        state = self.draft.gru_step(token_embed, state)
        logits = base_logits + self.draft.correction(z, state)
        return state, logits, logits.argmax(dim=-1)


def export_onnx(draft: DFlashDraftModel, lm_head_weight: torch.Tensor, block_path: Path, step_path: Path,
                opset: int) -> None:
    """fp32 draft (eval) + target LM head [V, H] -> the two checked ONNX graphs at the given paths."""
    if opset < MIN_OPSET:
        raise ValueError(f"ONNX opset {opset} is too old: the graphs need opset >= {MIN_OPSET}")
    cfg = draft.config
    B, H, G, V = cfg.block_size, cfg.hidden_size, cfg.gru_hidden_dim, cfg.vocab_size
    S = B + 1  # example context length; S is a dynamic axis
    block_args = (torch.randn(1, B, H), torch.arange(S, S + B)[None], torch.randn(1, S, cfg.num_feature_layers * H))
    _export(BlockForward(draft, lm_head_weight.detach().float()), block_args, block_path, opset,
            BLOCK_INPUTS, BLOCK_OUTPUTS, {"target_features": {1: "context_length"}})
    if cfg.use_domino_head:
        step_args = (torch.randn(1, H), torch.zeros(1, G), torch.randn(1, H), torch.randn(1, V))
        _export(RolloutStep(draft), step_args, step_path, opset, STEP_INPUTS, STEP_OUTPUTS, {})
    else:
        onnx.save(passthrough_step(H, G, V, opset), step_path)
    for path in (block_path, step_path):
        onnx.checker.check_model(str(path))  # by path: works past 2 GB


def passthrough_step(H: int, G: int, V: int, opset: int) -> onnx.ModelProto:
    """The rollout step of a head-off draft, same signature: state unchanged, logits = u, token = argmax u."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["state"], ["new_state"]),
            helper.make_node("Identity", ["base_logits"], ["logits"]),
            helper.make_node("ArgMax", ["base_logits"], ["token"], axis=-1, keepdims=0),
        ],
        "dflash_rollout_step",
        [value("z", f32, [1, H]), value("state", f32, [1, G]), value("token_embed", f32, [1, H]),
         value("base_logits", f32, [1, V])],
        [value("new_state", f32, [1, G]), value("logits", f32, [1, V]), value("token", i64, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _export(module: nn.Module, args: tuple, path: Path, opset: int, inputs: list[str], outputs: list[str],
            dynamic_axes: dict) -> None:
    """Trace `module` on `args` into `path` (TorchScript exporter: no extra dependencies)."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp, torch.no_grad(), warnings.catch_warnings():
        # The legacy exporter is deprecated but needs no onnxscript; the tracer's warnings concern
        # Python branches on config constants (e.g. GQA groups), fixed for a given draft.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = Path(tmp) / path.name
        torch.onnx.export(module.eval(), args, str(traced), dynamo=False, opset_version=opset, input_names=inputs,
                          output_names=outputs, dynamic_axes=dynamic_axes, do_constant_folding=True)
        write_single(traced, path)


def write_single(traced: Path, path: Path) -> None:
    """A traced graph -> `path`, its weights inline, or (past 2 GB, where the tracer wrote one file per
    weight) all in the single sidecar `<name>.data`."""
    if len(list(traced.parent.iterdir())) == 1:  # no external data files
        traced.replace(path)
        return
    model = onnx.load(str(traced))  # pulls the external weights in
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{path.name}.data")
