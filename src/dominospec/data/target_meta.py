"""What the data stages need of the target without its weights: the tokenizer and the identity.

`identity_without_weights` reads the layer count, width and vocabulary from the GGUF header or
`config.json` and fingerprints the files exactly as `dominospec.target.load_target` does, so the
identity recorded by prepare equals the one every later stage computes from the loaded model.
A hub target is loaded in full instead, because its revision is only known once resolved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dominospec.config import TargetParams
from dominospec.target import TargetError, TargetIdentity, fingerprint, load_target, resolve_source


def load_tokenizer(params: TargetParams) -> Any:
    """TargetParams -> the target's (fast) tokenizer, loaded the way load_target loads it."""
    from transformers import AutoTokenizer

    source, gguf_file, is_hub = resolve_source(params)
    kwargs: dict[str, Any] = dict(
        revision=params.revision, trust_remote_code=params.trust_remote_code, local_files_only=not is_hub
    )
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        raise TargetError(f"target.model: cannot load the tokenizer of '{params.model}': {err}") from err
    if not getattr(tokenizer, "is_fast", False):
        raise TargetError(f"target.model: '{params.model}' has no fast tokenizer (character offsets are needed)")
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"target.model: the tokenizer of '{params.model}' has no chat template")
    return tokenizer


def identity_without_weights(params: TargetParams) -> TargetIdentity:
    """TargetParams -> TargetIdentity equal to `load_target(params).identity`, reading headers only."""
    source, gguf_file, is_hub = resolve_source(params)
    if is_hub:
        return load_target(params).identity
    if gguf_file is not None:
        num_layers, hidden_size, vocab_size = _gguf_shapes(Path(source) / gguf_file)
        name = gguf_file
    else:
        config = json.loads((Path(source) / "config.json").read_text())
        num_layers, hidden_size, vocab_size = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
        name = Path(source).name
    return TargetIdentity(
        name=name,
        revision=None,
        sha256=fingerprint(source, gguf_file),
        dtype=params.dtype,
        num_layers=int(num_layers),
        hidden_size=int(hidden_size),
        vocab_size=int(vocab_size),
    )


def _gguf_shapes(path: Path) -> tuple[int, int, int]:
    """GGUF header -> (block count, embedding width, rows of the token embedding table)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    num_layers = reader.fields[f"{arch}.block_count"].contents()
    hidden_size = reader.fields[f"{arch}.embedding_length"].contents()
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise TargetError(f"{path}: GGUF without a token_embd.weight tensor")
    return num_layers, hidden_size, int(embed.n_elements) // int(hidden_size)
