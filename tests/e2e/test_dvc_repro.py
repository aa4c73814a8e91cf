"""`dvc repro` of the real dvc.yaml on a tiny setup: every stage runs, in order, from a fresh tree.

The tiny setup: a random 6-layer Llama (hidden 16) with the real SmolLM2 tokenizer and chat
template, the committed ShareGPT sample as a user data file, and small cache/train settings.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "sharegpt_sample.json"


def save_tiny_smollm_like_target(directory: Path) -> Path:
    """Random tiny Llama with SmolLM2's tokenizer (vocab 49152, chat template) -> directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from dominospec.config import load_params
    from dominospec.target import resolve_source

    source, gguf, _ = resolve_source(load_params(REPO / "params.yaml").target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_dvc_repro_runs_every_stage_on_a_tiny_setup(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    for item in ("dvc.yaml", "pipeline", "src", "models", "kernels"):
        src = REPO / item
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / item)
    target = save_tiny_smollm_like_target(tmp_path / "target")

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["target"].update(model=str(target), gguf_file=None, device="cpu")
    raw["prepare"].update(source=str(FIXTURE), max_length=256, val_fraction=0.3, test_fraction=0.3, num_proc=1)
    raw["regenerate"].update(max_new_tokens=16, batch_size=4)  # enabled as in the default: train and val rewritten
    raw["cache"].update(num_feature_layers=2, max_train_conversations=None, max_val_conversations=None)
    raw["draft"].update(block_size=4, gru_hidden_dim=16, emb_dim=8)
    raw["train"].update(max_steps=4, batch_size=2, num_anchors=4, val_every_steps=4, checkpoint_every_steps=2,
                        val_max_sequences=4, precision="32-true", accelerator="cpu")
    raw["evaluate"].update(max_prompts=2, max_new_tokens=16, suites=["sharegpt"])
    (work / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    env_bin = Path(sys.executable).parent
    dvc = [str(env_bin / "dvc")]
    subprocess.run(dvc + ["init", "--no-scm", "-q"], cwd=work, check=True)
    env = {"PATH": f"{env_bin}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(dvc + ["repro"], cwd=work, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    lock = yaml.safe_load((work / "dvc.lock").read_text())
    assert set(lock["stages"]) >= {"prepare", "regenerate", "cache", "train", "export", "evaluate", "serve_eval",
                                   "headline", "card"}
    prepare = json.loads((work / "metrics" / "prepare.json").read_text())
    assert prepare["conversations_read"] >= 5
    train = json.loads((work / "metrics" / "train.json").read_text())
    assert train["steps"] == 4
    assert (work / "artifacts" / "checkpoints" / "final" / "config.json").is_file()
    assert (work / "artifacts" / "draft" / "model.safetensors").is_file()
    evaluation = json.loads((work / "metrics" / "eval.json").read_text())
    suite = evaluation["suites"]["sharegpt"]
    assert suite["n_prompts"] == 2 and suite["exact_match"] == 1.0 and suite["acceptance_length"] >= 1.0
    # The model card comes last and quotes this run's evaluation of these weights, every document of it.
    card = (work / "artifacts" / "draft" / "README.md").read_text()
    assert evaluation["draft_sha256"] in card and "Not measured yet" not in card and "Not quoted" not in card
    tau = json.loads((work / "metrics" / "headline.json").read_text())["sharegpt"]["tau"]
    assert f"| sharegpt | {tau:.4g} |" in card  # headline.json's row

    # A second repro with nothing changed runs nothing.
    again = subprocess.run(dvc + ["repro"], cwd=work, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0
    assert "Running stage" not in again.stdout
