"""The export stage: outputs and model card, refusals with clear errors, nothing half-written.

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
from dominospec.files import sha256_file
from dominospec.export.stage import export


def test_outputs_and_model_card(exported, tiny_target_dir):
    draft = Path(exported.paths.draft)
    assert sorted(p.name for p in draft.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert Path(exported.paths.onnx).is_file() and Path(exported.paths.onnx_rollout).is_file()
    assert not [p.name for p in draft.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    mode = lambda name: (draft / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")  # as readable as the rest
    card = (draft / "README.md").read_text()
    # fp32 target: the card says why SGLang cannot serve it instead of showing a launch that fails
    assert "SGLang cannot serve it as configured: target.dtype: SGLang's Domino runtime needs bfloat16" in card
    assert "--speculative-domino-candidate-pool-size" not in card  # no flag advice for a launch that cannot run
    assert "make serve" in card
    sha = sha256_file(draft / "model.safetensors")
    assert sha in card
    for row in ("| val_acceptance_length | 2.346 |", "| conversations_read | 17 |", "| skipped.empty | 2 |",
                "| tokens | 4321 |", "| gru_hidden_dim (G) | 20 |", "| target_layer_ids | [1, 3] |"):
        assert row in card, row
    assert "gru_hidden_dim: 20" in card and f"max_steps: {exported.train.max_steps}" in card  # draft + train params
    assert "Not evaluated yet" in card


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
    export(params)  # the new export replaces the whole directory
    assert sorted(p.name for p in Path(params.paths.draft).iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (Path(params.paths.draft) / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert check_export_dir(params.paths.draft) == []


def test_eval_metrics_appear_only_for_these_weights(tmp_path, tiny_target_dir, tiny_target):
    params = project(tmp_path, tiny_target_dir, tiny_target)
    eval_file = Path(params.paths.metrics) / "eval.json"
    eval_file.write_text(json.dumps({"draft_sha256": "f" * 64, "sharegpt": {"speedup": 1.875}}))
    export(params)
    card = (Path(params.paths.draft) / "README.md").read_text()
    assert "was not measured on these weights" in card and "1.875" not in card
    sha = sha256_file(Path(params.paths.draft) / "model.safetensors")
    eval_file.write_text(json.dumps({"draft_sha256": sha, "sharegpt": {"speedup": 1.875}}))
    export(params)
    assert "| sharegpt.speedup | 1.875 |" in (Path(params.paths.draft) / "README.md").read_text()


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


def test_model_card_sglang_launch_is_the_one_make_serve_runs(exported, tiny_target_dir):
    """A bf16 HF target: the card shows exactly the argv `dominospec serve --backend sglang` executes."""
    import dataclasses
    import json

    from dominospec.export.card import sglang_lines

    params = dataclasses.replace(exported, target=dataclasses.replace(exported.target, dtype="bfloat16"))
    config = json.loads((Path(exported.paths.draft) / "config.json").read_text())
    draft, serve = exported.paths.draft, exported.serve
    assert sglang_lines(params, config)[1] == (
        f"python -m sglang.launch_server --model-path {tiny_target_dir} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {draft} --speculative-num-draft-tokens 4 "
        f"--host {serve.host} --port {serve.port} --dtype bfloat16"
        + "".join(f" {a}" for a in serve.sglang_args)
    )
