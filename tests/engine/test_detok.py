"""Incremental detokenisation (stops.IncrementalDetokenizer) equals decoding the whole answer, push by push.

Word-level tiny tokenizer with special tokens (skipped), and the byte-level BPE of SmolLM2 (its
tokenizer.json, no weights) on text with multi-byte characters split across tokens, pushed in
random chunk sizes.
Run: python -m pytest tests/engine/test_detok.py -q
"""

import random

import pytest
from engine_helpers import tiny_tokenizer

from dominospec.stops import IncrementalDetokenizer


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def check_pushes(tokenizer, ids: list[int], seed: int) -> None:
    rng = random.Random(seed)
    detok, at, deltas = IncrementalDetokenizer(decoder(tokenizer)), 0, []
    while at < len(ids):
        step = rng.randint(1, 4)
        deltas.append(detok.push(ids[at:at + step]))
        at += step
        assert detok.text == tokenizer.decode(ids[: detok.read_offset], skip_special_tokens=True)
        assert "".join(deltas) == detok.text
        assert detok.preview().startswith(detok.text) and "\ufffd" not in detok.preview()[-1:]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full.startswith(detok.text) and len(full) - len(detok.text) <= 4  # at most a held-back character


def test_word_level_tokenizer_with_special_tokens():
    tokenizer = tiny_tokenizer(16)
    rng = random.Random(0)
    for seed in range(20):
        check_pushes(tokenizer, [rng.randrange(16) for _ in range(30)], seed)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from pathlib import Path

    from dominospec.config import load_params
    from dominospec.target import resolve_source
    from transformers import AutoTokenizer

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    source, gguf, _ = resolve_source(params.target)
    return AutoTokenizer.from_pretrained(source, gguf_file=gguf, local_files_only=True)


TEXTS = [
    "The capital of France is Paris. Ünïcödé and 日本語のテキスト, emoji 🚀🎉 and code:\n    def f(x):\n        return x**2\n",
    "<|im_start|>assistant\nHello 👋🏽 — “quoted” text<|im_end|> tail",
]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_byte_level_bpe(smollm2_tokenizer, text):
    ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    for seed in range(5):
        check_pushes(smollm2_tokenizer, ids, seed)
    detok = IncrementalDetokenizer(decoder(smollm2_tokenizer))
    for t in ids:
        detok.push([t])
    assert detok.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
