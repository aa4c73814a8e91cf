"""Loading a draft from a checkpoint or an export dir, and refusing one made for another target.

Run: python -m pytest tests/engine/test_loading.py -q
"""

import copy
import json

import pytest
import torch
from engine_helpers import engine_params, tiny_draft, tiny_target

from dominospec.errors import UserError
from dominospec.config import Paths
from dominospec.draft import draft_dir, load_draft
from dominospec.engine import SpecEngine


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", vocab=40, dtype=torch.float32)


def test_checkpoint_and_bf16_export_load_in_the_target_dtype(target, tmp_path):
    draft = tiny_draft(target, block_size=4)
    draft.save_pretrained(tmp_path / "final")
    copy.deepcopy(draft).to(torch.bfloat16).save_pretrained(tmp_path / "export")
    loaded = load_draft(tmp_path / "final", target)
    exported = load_draft(tmp_path / "export", target)
    assert loaded.fc.weight.dtype == exported.fc.weight.dtype == torch.float32
    for (name, a), b in zip(draft.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(exported.fc.weight, loaded.fc.weight)  # the export really went through bf16
    prompt = [5, 9, 11, 3]
    a = SpecEngine(target, loaded, "domino", params=engine_params()).generate(prompt, 12)
    b = SpecEngine(target, exported, "domino", params=engine_params()).generate(prompt, 12)
    assert a.token_ids == b.token_ids  # greedy spec == AR whatever the draft's precision


def test_draft_for_another_target_is_refused(target, tmp_path):
    other = tiny_target("qwen3", vocab=40, dtype=torch.float32, seed=9)  # same shapes, other weights
    foreign = tiny_draft(other, block_size=4)
    with pytest.raises(UserError, match="trained for target 'tiny-qwen3-9'.*not 'tiny-qwen3-0'"):
        SpecEngine(target, foreign, "domino", params=engine_params())
    foreign.save_pretrained(tmp_path / "foreign")
    with pytest.raises(UserError, match="trained for target"):
        load_draft(tmp_path / "foreign", target)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(vocab_size=41), "vocab_size 41 != target's 40"),
        (dict(num_target_layers=7), "num_target_layers 7 != target's 4"),
        (dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=1), "hidden_size 24 != target's 32"),
        (dict(dflash_config=dict(mask_token_id=39, target_layer_ids=[0, 3], gru_hidden_dim=16, emb_dim=8)),
         r"target_layer_ids \[0, 3\] out of range 0..2"),
    ],
)
def test_shape_mismatches_are_named(target, overrides, message):
    draft = tiny_draft(target, block_size=4, **overrides)
    with pytest.raises(UserError, match=message):
        SpecEngine(target, draft, "dflash", params=engine_params())


def test_head_off_draft_cannot_run_domino_mode_and_ar_needs_no_draft(target):
    draft = tiny_draft(target, block_size=4, head=False)
    SpecEngine(target, draft, "dflash", params=engine_params())
    with pytest.raises(UserError, match="use_domino_head is false"):
        SpecEngine(target, draft, "domino", params=engine_params())
    with pytest.raises(UserError, match="needs a draft"):
        SpecEngine(target, None, "domino", params=engine_params())
    with pytest.raises(UserError, match="unknown decoding mode 'eagle'"):
        SpecEngine(target, None, "eagle", params=engine_params())


def test_missing_or_foreign_directories_are_named(target, tmp_path):
    with pytest.raises(UserError, match="no draft at .*run the train stage"):
        load_draft(tmp_path / "nothing", target)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "qwen3"}))
    with pytest.raises(UserError, match="architectures"):
        load_draft(tmp_path / "llama", target)


def test_draft_dir_prefers_the_export(tmp_path):
    paths = Paths(prepared="p", regenerated="r", cache="c", checkpoints=str(tmp_path / "ckpt"),
                  draft=str(tmp_path / "draft"), onnx="o", onnx_rollout="or", metrics="m", plots="pl")
    assert draft_dir(paths) == tmp_path / "ckpt" / "final"
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    assert draft_dir(paths) == tmp_path / "draft"
