"""Test helpers for the cache: tiny targets (random Llama / Qwen3 from configs), random data, params."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
VOCAB = 300


def save_tiny_target(directory: Path, arch: str) -> Path:
    """Random tiny causal LM (`llama` 6 layers | `qwen3` 5 layers, hidden 32, vocab 300) + tokenizer -> directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":
        config = LlamaConfig(num_hidden_layers=6, tie_word_embeddings=True, **common)
    else:
        config = Qwen3Config(num_hidden_layers=5, head_dim=8, tie_word_embeddings=False, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the 0.02 default init, so layers differ visibly
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t2"
    ).save_pretrained(directory)
    return directory


def target_params(target_dir: Path):
    """TargetParams for a tiny target directory (float32, cpu)."""
    from dominospec.config import TargetParams

    return TargetParams(
        model=str(target_dir), gguf_file=None, revision=None, dtype="float32", device="cpu",
        trust_remote_code=False, mask_token_id=None, chat_template_kwargs={},
    )


def save_regenerated(
    directory: Path, identity: dict, sizes: dict[str, int], max_len: int = 48, seed: int = 0, min_len: int = 3
) -> Path:
    """Random conversations written by the data stages' own writer: DatasetDict + meta.json."""
    import datasets

    from dominospec.data.dataset import FEATURES, write_dataset

    g = torch.Generator().manual_seed(seed)
    splits = {}
    for split, n in sizes.items():
        rows = {"id": [], "messages": [], "input_ids": [], "loss_mask": [], "num_tokens": []}
        for i in range(n):
            length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
            prompt = int(torch.randint(1, length, (1,), generator=g))
            rows["id"].append(f"{split}-{i}")
            rows["messages"].append([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
            rows["input_ids"].append(ids)
            rows["loss_mask"].append([0] * prompt + [1] * (length - prompt))
            rows["num_tokens"].append(length)
        splits[split] = datasets.Dataset.from_dict(rows, features=FEATURES)
    meta = {"format_version": 1, "target": identity, "mask_token_id": 7, "max_length": max_len, "source": "random"}
    write_dataset(directory, datasets.DatasetDict(splits), meta)
    return directory


def write_params(path: Path, target_dir: Path, root: Path, **cache) -> Path:
    """The repo's params.yaml with paths under `root`, the tiny target, and `cache` overrides -> path."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for key in raw["paths"]:
        raw["paths"][key] = str(root / key)
    raw["target"].update(model=str(target_dir), gguf_file=None, device="cpu", dtype="float32")
    raw["cache"].update(cache)
    path.write_text(yaml.safe_dump(raw))
    return path
