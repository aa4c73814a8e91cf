"""The export stage: outputs, refusals with clear errors, nothing half-written.

Run: python -m pytest tests/export/test_export_stage.py -q
"""

import json
import re
from pathlib import Path

import pytest
import torch
from export_helpers import make_project, save_checkpoint
from safetensors.torch import load_file, save_file

from dominospec.cli import stage_main
from dominospec.errors import UserError
from dominospec.config import load_params
from dominospec.export import check_export_dir
from dominospec.export import stage as export_stage
from dominospec.export.stage import export


def test_outputs(exported):
    """The HF directory holds the contract's two files and nothing else: its model card comes after evaluation."""
    draft = Path(exported.paths.draft)
    assert sorted(p.name for p in draft.iterdir()) == ["config.json", "model.safetensors"]
    assert Path(exported.paths.onnx).is_file() and Path(exported.paths.onnx_rollout).is_file()
    assert not [p.name for p in draft.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    mode = lambda name: (draft / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")  # as readable as the rest


def project(tmp_path, tiny_target_dir, tiny_target, **kwargs):
    return load_params(make_project(tmp_path, tiny_target_dir, tiny_target.identity.as_dict(), **kwargs))


def assert_nothing_written(params) -> None:
    root = Path(params.paths.draft).parent
    assert not Path(params.paths.draft).exists() and not Path(params.paths.onnx).exists()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]


def test_missing_checkpoint_is_named(tmp_path, tiny_target_dir, tiny_target):
    params = project(tmp_path, tiny_target_dir, tiny_target)
    final = Path(params.paths.checkpoints) / "final"
    (final / "config.json").unlink()
    with pytest.raises(UserError, match=re.escape(f"no trained draft at {final}") + ".*run the train stage"):
        export(params)
    assert_nothing_written(params)


def test_checkpoint_without_a_head_tensor_is_refused(tmp_path, tiny_target_dir, tiny_target):
    params = project(tmp_path, tiny_target_dir, tiny_target)
    weights = Path(params.paths.checkpoints) / "final" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["prefix_gru.weight_hh_l0"]
    save_file(tensors, weights)
    with pytest.raises(UserError, match="tensor prefix_gru.weight_hh_l0 is missing"):
        export(params)
    assert_nothing_written(params)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["dflash_config"].update(shift_label=False), "shift_label"),
        (lambda c: c["dflash_config"].update(pure_draft_prefix_len=2), "pure_draft_prefix_len must be 1, got 2"),
        (lambda c: c["dflash_config"].update(mask_token_id=None), "mask_token_id None is not a token id"),
    ],
)
def test_checkpoint_config_off_the_contract_is_refused(tmp_path, tiny_target_dir, tiny_target, edit, message):
    params = project(tmp_path, tiny_target_dir, tiny_target)
    config_file = Path(params.paths.checkpoints) / "final" / "config.json"
    config = json.loads(config_file.read_text())
    edit(config)
    config_file.write_text(json.dumps(config))
    with pytest.raises(UserError, match=re.escape(message)):
        export(params)
    assert_nothing_written(params)


def test_checkpoint_for_another_target_is_refused(tmp_path, tiny_target_dir, tiny_target):
    identity = {**tiny_target.identity.as_dict(), "sha256": "0" * 64}
    params = load_params(make_project(tmp_path, tiny_target_dir, identity))
    with pytest.raises(UserError, match="trained for target"):
        export(params)
    assert_nothing_written(params)


def test_checkpoint_trained_with_other_draft_params_is_refused(tmp_path, tiny_target_dir, tiny_target):
    params = project(tmp_path, tiny_target_dir, tiny_target, draft_params=dict(block_size=8))
    with pytest.raises(UserError, match="draft.block_size is 8 in params but 4 in the checkpoint"):
        export(params)


def test_failure_midway_leaves_the_previous_export_untouched(tmp_path, tiny_target_dir, tiny_target, monkeypatch):
    params = project(tmp_path, tiny_target_dir, tiny_target)
    export(params)
    before = {p.name: p.read_bytes() for p in Path(params.paths.draft).iterdir()}
    onnx_before = Path(params.paths.onnx).read_bytes()
    save_checkpoint(Path(params.paths.checkpoints) / "final", tiny_target.identity.as_dict(), seed=1)  # new weights

    def broken_onnx(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_stage, "export_onnx", broken_onnx)
    with pytest.raises(RuntimeError, match="disk full"):
        export(params)
    assert {p.name: p.read_bytes() for p in Path(params.paths.draft).iterdir()} == before
    assert Path(params.paths.onnx).read_bytes() == onnx_before
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]

    monkeypatch.undo()
    (Path(params.paths.draft) / "stale.bin").write_bytes(b"x")
    (Path(params.paths.draft) / "README.md").write_text("the card of the previous weights")
    export(params)  # the new export replaces the whole directory: no card of other weights stays beside it
    assert sorted(p.name for p in Path(params.paths.draft).iterdir()) == ["config.json", "model.safetensors"]
    assert (Path(params.paths.draft) / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert check_export_dir(params.paths.draft) == []


def test_pipeline_script_reports_a_missing_checkpoint_in_one_line(tmp_path, tiny_target_dir, tiny_target, capsys):
    params = project(tmp_path, tiny_target_dir, tiny_target)
    (Path(params.paths.checkpoints) / "final" / "config.json").unlink()
    capsys.readouterr()  # drop the set-up's progress bars
    assert stage_main("export", ["--params", str(params.source)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no trained draft at") and "\n" not in err


def test_weights_are_the_checkpoint_rounded_to_bf16(exported):
    checkpoint = load_file(Path(exported.paths.checkpoints) / "final" / "model.safetensors")
    exported_tensors = load_file(Path(exported.paths.draft) / "model.safetensors")
    for name, tensor in exported_tensors.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, checkpoint[name].to(torch.bfloat16)), name
