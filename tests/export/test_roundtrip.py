"""Export -> load back: the exported draft is the checkpoint rounded to bf16, bit for bit, in the model
and in the engine (identical greedy generations and per-round acceptance).

Run: python -m pytest tests/export/test_roundtrip.py -q
"""

from pathlib import Path

import pytest
import torch
from export_helpers import make_project

from engine_helpers import engine_params  # noqa: E402

from dominospec.config import load_params  # noqa: E402
from dominospec.draft import load_draft  # noqa: E402
from dominospec.engine import SpecEngine  # noqa: E402
from dominospec.export.stage import export  # noqa: E402
from dominospec.models.domino import DFlashDraftModel  # noqa: E402


def rounded_checkpoint(path) -> DFlashDraftModel:
    """The checkpoint in fp32 with every weight rounded through bf16: what the export should hold."""
    draft = DFlashDraftModel.from_pretrained(path).float().eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(p.bfloat16().float())
    return draft


def block_inputs(seed: int, S: int = 9):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, 4, 32, generator=g)
    positions = torch.arange(S, S + 4)[None]
    features = torch.randn(1, S, 64, generator=g)
    return embeds, positions, features


def test_export_loads_back_as_the_bf16_rounded_checkpoint(exported):
    checkpoint = Path(exported.paths.checkpoints) / "final"
    loaded, info = DFlashDraftModel.from_pretrained(exported.paths.draft, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.fc.weight.dtype == torch.bfloat16
    loaded = loaded.float().eval()
    reference = rounded_checkpoint(checkpoint)
    original = DFlashDraftModel.from_pretrained(checkpoint).float().eval()
    assert not torch.equal(original.fc.weight, reference.fc.weight)  # rounding really changed the weights
    for (name, a), b in zip(reference.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name

    # Equal weights; outputs equal to fp32 rounding (CPU matmul kernels round by memory alignment),
    # far below the bf16 rounding that separates them from the unrounded checkpoint.
    with torch.no_grad():
        embeds, positions, features = block_inputs(0)
        z, z_ref = (m(embeds, positions, target_features=features) for m in (loaded, reference))
        assert_fp32_equal(z, z_ref, original(embeds, positions, target_features=features))
        zero = torch.zeros(1, 20)
        state, state_ref = loaded.gru_step(embeds[:, 0], zero), reference.gru_step(embeds[:, 0], zero)
        assert_fp32_equal(state, state_ref, original.gru_step(embeds[:, 0], zero))
        assert_fp32_equal(loaded.correction(z[:, 1], state), reference.correction(z[:, 1], state),
                          original.correction(z[:, 1], state))


def assert_fp32_equal(got: torch.Tensor, want: torch.Tensor, unrounded: torch.Tensor) -> None:
    """|got - want| within 8 fp32 ulps of the output scale, and the bf16 signal 100x larger than that."""
    tol = 8 * torch.finfo(torch.float32).eps * want.abs().max()
    assert (got - want).abs().max() <= tol
    assert (unrounded - want).abs().max() > 100 * tol

PROMPTS = [[5, 9, 11, 3], [40, 41, 42, 43, 44, 45], [7], [250, 13, 99, 17, 18]]


def test_engine_generates_identically_from_export_and_rounded_checkpoint(exported, tiny_target):
    from_export = load_draft(exported.paths.draft, tiny_target)
    from_checkpoint = load_draft(Path(exported.paths.checkpoints) / "final", tiny_target)
    with torch.no_grad():
        for p in from_checkpoint.parameters():
            p.copy_(p.bfloat16().float())
    for (name, a), b in zip(from_checkpoint.state_dict().items(), from_export.state_dict().values()):
        assert torch.equal(a, b), name
    ar = SpecEngine(tiny_target, None, "ar", params=engine_params())
    for prompt in PROMPTS:
        a = SpecEngine(tiny_target, from_export, "domino", params=engine_params()).generate(prompt, 16)
        b = SpecEngine(tiny_target, from_checkpoint, "domino", params=engine_params()).generate(prompt, 16)
        assert a.token_ids == b.token_ids == ar.generate(prompt, 16).token_ids
        assert a.stats.accepted_lengths == b.stats.accepted_lengths
        assert a.stats.position_accepted == b.stats.position_accepted


@pytest.fixture(scope="module")
def exported_head_off(tmp_path_factory, tiny_target_dir, tiny_target):
    root = tmp_path_factory.mktemp("head_off")
    params = load_params(make_project(root, tiny_target_dir, tiny_target.identity.as_dict(),
                                      draft_params=dict(use_domino_head=False), use_domino_head=False))
    export(params)
    return params


def test_head_off_draft_exports_as_plain_dflash_and_serves_in_the_engine(exported_head_off, tiny_target):
    import json

    from safetensors import safe_open

    config = json.loads((Path(exported_head_off.paths.draft) / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 299, "target_layer_ids": [1, 3]}
    assert "emb_dim" not in config and config["use_domino_head"] is False
    with safe_open(Path(exported_head_off.paths.draft) / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert len(names) == 25 and not any(n.startswith(("prefix_gru", "embed_proj")) for n in names)

    import onnx

    step = onnx.load(exported_head_off.paths.onnx_rollout)  # same interface as the Domino step
    assert [i.name for i in step.graph.input] == ["z", "state", "token_embed", "base_logits"]
    draft = load_draft(exported_head_off.paths.draft, tiny_target)
    reference = rounded_checkpoint(Path(exported_head_off.paths.checkpoints) / "final")
    backbone = {k: v for k, v in reference.state_dict().items() if not k.startswith(("prefix_gru", "embed_proj"))}
    loaded = draft.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in backbone.items())
    ar = SpecEngine(tiny_target, None, "ar", params=engine_params())
    for prompt in PROMPTS[:2]:
        assert SpecEngine(tiny_target, draft, "dflash", params=engine_params()).generate(prompt, 12).token_ids == ar.generate(prompt, 12).token_ids
