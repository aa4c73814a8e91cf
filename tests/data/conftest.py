"""Fixtures for the data-stage tests: the real SmolLM2 tokenizer and a tiny random target built on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import load_smollm2_tokenizer, save_tiny_target


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML template, EOS = <|im_end|>), read from the packaged GGUF."""
    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A saved random 2-layer Llama with SmolLM2's vocabulary and tokenizer (an HF directory)."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny_target"), smollm2_tokenizer)
