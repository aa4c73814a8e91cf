"""Test helpers for the data stages: the real SmolLM2 tokenizer, a tiny random target using it, params files."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
SHAREGPT_SAMPLE = REPO / "tests" / "fixtures" / "sharegpt_sample.json"


def sample_records() -> list[dict[str, Any]]:
    """The real ShareGPT records of the fixture file, in file order."""
    return json.loads(SHAREGPT_SAMPLE.read_text())


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
