"""The prepare stage end to end on real ShareGPT records, through a params file, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import (  # noqa: F401 (fixtures)
    REPO,
    SHAREGPT_SAMPLE,
    qwen3_tokenizer,
    qwen3_tokenizer_dir,
    sample_records,
    smollm2_tokenizer,
    supervised_runs,
    tiny_target_dir,
    write_params,
)

from dominospec.errors import UserError
from dominospec.config import load_params
from dominospec.data.conversations import assign_split
from dominospec.data.dataset import FEATURES, read_dataset
from dominospec.data.prepare import choose_mask_token, prepare
from dominospec.data.target_meta import identity_without_weights
from dominospec.target import load_target

# The sample's two-sided conversations; RnwpeOH_0 opens with a 2,500-token prompt, so at the default
# max_length 1024 nothing of it is left to supervise.
KEPT = ["i6IyJda_0", "J410gdS_0", "WJidmXp_0", "X1NXUxZ_0", "lheleG7_0", "95NWF4s_0", "52n0vlZ_0", "8fC32jy_43",
        "yV4WPEy_0", "JPSehOX_0"]  # fmt: skip


def _tiny(target_dir) -> dict:
    """The target section for the tiny HF-directory target (same tokenizer as the default, instant identity)."""
    return {"model": str(target_dir), "gguf_file": None}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target_dir):
    """The fixture file prepared with generous splits: (params, splits, meta, metrics)."""
    root = tmp_path_factory.mktemp("prepared")
    prepare_section = {"source": str(SHAREGPT_SAMPLE), "val_fraction": 0.25, "test_fraction": 0.25, "split_seed": 1}
    params = load_params(write_params(root / "params.yaml", root, prepare=prepare_section, target=_tiny(tiny_target_dir)))
    prepare(params)
    splits, meta = read_dataset(params.paths.prepared)
    metrics = json.loads((root / "metrics" / "prepare.json").read_text())
    return params, splits, meta, metrics


def test_prepare_writes_every_usable_conversation_once_in_its_split(prepared, smollm2_tokenizer):
    params, splits, meta, metrics = prepared
    rows = {split: list(data) for split, data in splits.items()}
    ids = [r["id"] for split in rows.values() for r in split]
    assert sorted(ids) == sorted(KEPT)
    for split, split_rows in rows.items():
        for row in split_rows:
            assert assign_split(row["id"], 1, 0.25, 0.25) == split
            reference = smollm2_tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
            assert row["input_ids"] == list(reference)[: params.prepare.max_length]
            assert row["num_tokens"] == len(row["input_ids"]) == len(row["loss_mask"])
            assert set(row["loss_mask"]) == {0, 1}
    assert all(len(rows[s]) > 0 for s in ("train", "val", "test"))  # seed 1 fills every split of this sample
    for split in splits.values():
        assert split.features == FEATURES


def test_prepare_meta_records_target_mask_token_and_format(prepared):
    params, _, meta, _ = prepared
    assert set(meta) == {"format_version", "target", "mask_token_id", "max_length", "source"}
    assert meta["format_version"] == 1 and meta["max_length"] == params.prepare.max_length
    assert meta["source"] == str(SHAREGPT_SAMPLE)
    assert meta["target"] == load_target(params.target).identity.as_dict()
    assert meta["mask_token_id"] == 16  # <empty_output>: the first candidate, absent from this sample


def test_prepare_metrics_account_for_every_record(prepared):
    _, splits, _, metrics = prepared
    assert metrics["conversations_read"] == len(sample_records()) == 15
    assert metrics["conversations_kept"] == len(KEPT)
    assert metrics["skipped"] == {"empty_conversation": 1, "no_assistant_tokens": 1, "one_sided": 3}
    assert metrics["conversations_kept"] + sum(metrics["skipped"].values()) == metrics["conversations_read"]
    assert metrics["splits"] == {s: len(d) for s, d in splits.items()}
    assert metrics["tokens"] == sum(sum(d["num_tokens"]) for d in splits.values())
    assert metrics["assistant_tokens"] == sum(int(np.sum(m)) for d in splits.values() for m in d["loss_mask"])
    assert metrics["truncated_conversations"] == 0  # every kept conversation fits in 1024 tokens
    assert metrics["mask_token_id"] == 16 and metrics["seconds"] > 0


def test_prepare_keeps_multi_turn_conversations_under_qwen3s_template(tmp_path, qwen3_tokenizer_dir, qwen3_tokenizer):
    """Qwen3 with thinking off (params/qwen3-8b.yaml) renders the last reply after an empty think block and answered
    ones without: the sample's multi-turn conversations are kept all the same, masked on exactly their replies; a
    reply right after a reply is joined to it (alone, its prompt would show the previous reply's think block, which
    the conversation does not), and the joined reply is supervised whole."""
    target = tmp_path / "qwen3"  # the tokenizer and a config: all prepare reads of a target
    shutil.copytree(qwen3_tokenizer_dir, target)
    config = {"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "vocab_size": 151936}
    (target / "config.json").write_text(json.dumps(config))
    turns = [("human", "Name a prime."), ("gpt", "2."), ("gpt", "Or 3.")]
    twice = {"id": "twice", "conversations": [{"from": role, "value": text} for role, text in turns]}
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*sample_records(), twice]))
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare={"source": str(source)},
                                      target={"model": str(target), "gguf_file": None,
                                              "chat_template_kwargs": {"enable_thinking": False}}))  # fmt: skip
    prepare(params)
    splits, _ = read_dataset(params.paths.prepared)
    metrics = json.loads((tmp_path / "metrics" / "prepare.json").read_text())
    rows = [r for d in splits.values() for r in d]
    assert sorted(r["id"] for r in rows) == sorted([*KEPT, "twice"])
    assert metrics["skipped"] == {"empty_conversation": 1, "no_assistant_tokens": 1, "one_sided": 3}
    assert metrics["dropped_messages"]["joined_to_previous_reply"] == 1
    (joined,) = [r for r in rows if r["id"] == "twice"]
    assert joined["messages"][1:] == [{"role": "assistant", "content": "2.\n\nOr 3."}]
    assert sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows) == 4
    for row in rows:
        reference = qwen3_tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        assert row["input_ids"] == list(reference)  # every kept conversation fits in 1024 tokens
        runs = supervised_runs(row["input_ids"], row["loss_mask"])
        replies = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert [qwen3_tokenizer.decode(run) for run in runs] == replies


def test_short_max_length_truncates_and_skips_conversations_without_a_reply(tmp_path, tiny_target_dir):
    prepare_section = {"source": str(SHAREGPT_SAMPLE), "max_length": 64}
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare=prepare_section, target=_tiny(tiny_target_dir)))
    prepare(params)
    splits, _ = read_dataset(params.paths.prepared)
    metrics = json.loads((tmp_path / "metrics" / "prepare.json").read_text())
    lengths = [n for d in splits.values() for n in d["num_tokens"]]
    assert max(lengths) <= 64 and metrics["truncated_conversations"] == sum(n == 64 for n in lengths) > 0
    # Prompts longer than 64 tokens leave nothing to supervise: skipped by name, not kept empty.
    assert metrics["skipped"]["no_assistant_tokens"] > 0
    assert all(sum(m) > 0 for d in splits.values() for m in d["loss_mask"])
    assert metrics["conversations_kept"] == len(KEPT) + 1 - metrics["skipped"]["no_assistant_tokens"]


def test_a_train_conversation_opening_with_a_test_prompt_is_dropped_and_counted(tmp_path, tiny_target_dir):
    records = sample_records()
    split_of = {r["id"]: assign_split(r["id"], 1, 0.25, 0.25) for r in records}
    test_id = next(i for i in KEPT if split_of[i] == "test")
    test_prompt = next(r for r in records if r["id"] == test_id)["conversations"][0]
    # a new train conversation (its id hashes to train) that opens with the test conversation's prompt
    copy_id = next(f"copy{k}" for k in range(100) if assign_split(f"copy{k}", 1, 0.25, 0.25) == "train")
    copy = {"id": copy_id, "conversations": [test_prompt, {"from": "gpt", "value": "An answer to learn."}]}
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*records, copy]))
    section = {"source": str(source), "val_fraction": 0.25, "test_fraction": 0.25, "split_seed": 1}
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare=section, target=_tiny(tiny_target_dir)))
    prepare(params)
    splits, _ = read_dataset(params.paths.prepared)
    metrics = json.loads((tmp_path / "metrics" / "prepare.json").read_text())
    assert sorted(i for d in splits.values() for i in d["id"]) == sorted(KEPT)  # the copy is not trained on
    assert test_id in splits["test"]["id"]  # the test suite keeps its prompt
    assert metrics["skipped"]["train_prompt_held_out"] == 1
    assert metrics["conversations_kept"] + sum(metrics["skipped"].values()) == metrics["conversations_read"] == 16


def test_mask_token_skips_candidates_that_occur_in_the_data(tmp_path, tiny_target_dir):
    record = {"id": "uses-mask", "conversations": [{"from": "human", "value": "what does <empty_output> mean?"},
                                                   {"from": "gpt", "value": "An empty cell output."}]}  # fmt: skip
    source = tmp_path / "data.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*sample_records(), record]))
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare={"source": str(source)}, target=_tiny(tiny_target_dir)))
    prepare(params)
    _, meta = read_dataset(params.paths.prepared)
    assert meta["mask_token_id"] == 15  # <jupyter_script>: 16 occurs in "uses-mask"

    configured = load_params(write_params(tmp_path / "q.yaml", tmp_path, prepare={"source": str(source)},
                                          target={**_tiny(tiny_target_dir), "mask_token_id": 16}))  # fmt: skip
    with pytest.raises(UserError, match=r"target.mask_token_id 16 \('<empty_output>'\) occurs in the data"):
        prepare(configured)


def test_choose_mask_token_takes_the_first_unused_candidate(smollm2_tokenizer):
    assert choose_mask_token([16, 15, 14], [[16], [], [16]], None, smollm2_tokenizer) == 15
    assert choose_mask_token([16, 15, 14], [[]], None, smollm2_tokenizer) == 16
    with pytest.raises(UserError, match="every candidate"):
        choose_mask_token([16, 15], [[15], [16]], None, smollm2_tokenizer)


def test_a_failing_run_leaves_the_previous_output_intact(prepared, tmp_path):
    params, splits, meta, _ = prepared
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    broken = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare={"source": str(bad)}))
    broken = dataclasses.replace(broken, paths=params.paths)  # the same output directory
    with pytest.raises(UserError, match="not JSON"):
        prepare(broken)
    again, meta_again = read_dataset(params.paths.prepared)
    assert meta_again == meta and {s: list(d["id"]) for s, d in again.items()} == {s: list(d["id"]) for s, d in splits.items()}


def test_bad_fractions_are_a_user_error(tmp_path):
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare={"val_fraction": 0.6, "test_fraction": 0.4}))
    with pytest.raises(UserError, match="val_fraction \\+ prepare.test_fraction"):
        prepare(params)


def test_pipeline_script_reports_bad_input_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n{broken\n')
    params_file = write_params(tmp_path / "p.yaml", tmp_path, prepare={"source": str(bad)})
    done = subprocess.run([sys.executable, "pipeline/prepare.py", "--params", str(params_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {bad}: not JSON: line 2 column 2: Expecting property name enclosed in double quotes"
    )
    assert not (tmp_path / "data" / "prepared").exists()


def test_identity_without_weights_matches_load_target_for_an_hf_directory(tiny_target_dir, tmp_path):
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, target={"model": str(tiny_target_dir), "gguf_file": None}))
    assert identity_without_weights(params.target) == load_target(params.target).identity


@pytest.mark.slow
def test_prepare_for_the_gguf_default_records_the_identity_load_target_computes(tmp_path):
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare={"source": str(SHAREGPT_SAMPLE)}))
    prepare(params)
    _, meta = read_dataset(params.paths.prepared)
    identity = load_target(params.target).identity
    assert meta["target"] == identity.as_dict()
    assert (identity.name, identity.num_layers, identity.hidden_size, identity.vocab_size) == (
        "SmolLM2-135M-Instruct.Q4_1.gguf", 30, 576, 49152)  # fmt: skip


def test_a_source_without_any_usable_conversation_is_a_user_error(tmp_path):
    source = tmp_path / "one_sided.jsonl"
    source.write_text('{"id": "a", "conversations": [{"from": "human", "value": "anyone?"}]}\n["not a record"]\n')
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path, prepare={"source": str(source)}))
    with pytest.raises(UserError, match=r"no usable conversation \(skipped: \{'one_sided': 1, 'not_an_object': 1\}\)"):
        prepare(params)
