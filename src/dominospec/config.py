"""Typed, frozen view of `params.yaml`: the one file of tunables.

`load_params(path) -> Params` reads the YAML once and builds one frozen dataclass per
section. Every key must be known and every value must have the declared type; the first
problem raises `ParamsError` naming the file and the dotted key, before any work starts:

    params.yaml: unknown key 'cache.layres'
    params.yaml: 'cache.batch_tokens' must be int, got str ('many')

A preset, `params/NAME.yaml`, holds only the keys that differ from the params.yaml beside `params/`;
`read_params` overlays it on that file (`overlay`), so a preset loads like a complete file, and
`dominospec preset NAME` (dominospec.presets) writes the overlay into params.yaml, where DVC sees it.

Stage name = pipeline script name = params section. Sections without a stage (`paths`,
`target`, `mlflow`) are shared by all stages.
`serve` configures `dominospec serve` (no DVC stage: serving is not a pipeline step).
`retrain` configures `dominospec retrain` (no DVC stage: it runs the pipeline, then gates its result).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from dominospec.errors import ParamsError

# keys that were renamed or retired -> what an old params file that sets one is told (no alias: it fails)
FIRST_TOKEN_TREE = ("the first-token tree is retired: DominoTree (engine.tree.shape: best_first) is domino's tree, "
                    "its budget engine.tree.nodes")
GONE = {
    "engine.tree_nodes": "replaced by engine.tree.nodes",
    "engine.tree_children": "replaced by engine.tree.children",
    "engine.tree_width": FIRST_TOKEN_TREE,
    "engine.tree.width": FIRST_TOKEN_TREE,
}
RETIRED_VALUES = {("engine.tree.shape", "first_token"): FIRST_TOKEN_TREE}  # (key, value) -> why it is gone
PRESETS = "params"  # the folder beside params.yaml whose NAME.yaml files are presets over it
PRESET_STAMP = re.compile(r"# preset: ([\w.-]+)")  # params.yaml's first line once `dominospec preset NAME` wrote it


@dataclass(frozen=True)
class Paths:
    """Every artefact location, written once; dvc.yaml reads these through `${paths.*}`."""

    prepared: str
    regenerated: str
    cache: str
    checkpoints: str
    draft: str
    onnx: str  # the draft's block forward (fp32 ONNX)
    onnx_rollout: str  # one Domino rollout step (fp32 ONNX)
    metrics: str
    plots: str


@dataclass(frozen=True)
class TargetParams:
    """Which target model to load: a hub id, a local HF directory, a GGUF file, or
    `package:<python package>` for a model shipped inside an installed package."""

    model: str
    gguf_file: Optional[str]
    revision: Optional[str]
    dtype: Literal["float32", "bfloat16", "float16"]
    device: str  # "auto" | "cpu" | "cuda" | "cuda:N"
    trust_remote_code: bool
    mask_token_id: Optional[int]  # None: the target's own mask token, else an unused special token
    # Variables of the chat template wherever a prompt is rendered for the target to answer (prepare, regenerate,
    # evaluate, serve): the form users run it in, e.g. Qwen3's {enable_thinking: false}. A template ignores unknown ones.
    chat_template_kwargs: dict[str, Union[bool, int, str, float]]


@dataclass(frozen=True)
class PrepareParams:
    """Conversations -> tokenized chat-template renderings with assistant loss masks."""

    source: str  # "sharegpt" (packaged ShareGPT V3) | a .json/.jsonl path | "hub:<dataset id>"
    hub_split: str
    max_length: int
    val_fraction: float
    test_fraction: float
    split_seed: int
    num_proc: int


@dataclass(frozen=True)
class RegenerateParams:
    """Optional: the target rewrites the assistant turns of the train split."""

    enabled: bool
    max_conversations: Optional[int]
    original_conversations: int  # train conversations after the rewritten ones, kept with their original replies (0 = none)
    max_val_conversations: Optional[int]  # val conversations rewritten too (0: val copied unchanged)
    code_prompts: int  # Python functions the target is asked to complete, its answers added to train (0 = none)
    code_prompts_root: str  # where those functions come from: "stdlib" | a folder of .py files
    max_turns: Optional[int]  # assistant turns kept and rewritten per conversation (null: all)
    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int
    seed: int
    dtype: Literal["auto", "float32", "bfloat16", "float16"]  # regeneration compute dtype (the target is cast to it); auto: precision.py
    linear: Literal["packed", "torch"]  # packed: the target's linears pre-packed for oneDNN (CPU fp32/bf16)
    loop_ngram: Optional[int]  # None/0: keep repetition loops; n: cut a reply once an n-gram recurs
    loop_repeats: int  # ... `loop_repeats` times (>= 2); the reply keeps one copy of the loop
    num_threads: Optional[int]  # torch CPU threads while regenerating; null = torch's default
    decoder: Literal["stream", "static"]  # stream: today's slot decoder; static: independent replies, batched (regenerate.static_decoder)
    samples: int  # static: sampled replies per prompt at each of sample_temperatures, beside the main one (0 = none)
    sample_temperatures: list[float]
    magpie_prompts: int  # static: prompts the target writes itself from the template's user prefix (0 = none)
    magpie_temperature: float
    magpie_max_prompt_tokens: int
    magpie_min_prompt_tokens: int
    dedup: Literal["none", "tokens", "text"]  # static: drop repeated sequences (exact token ids, or normalised text)
    chunk_replies: int  # static: replies per journaled chunk
    prefill_tokens: int  # static: tokens per prefill forward
    cuda_graphs: bool  # static on CUDA: one CUDA graph per decode-step shape
    attention: Literal["auto", "rows", "padded"]  # static's decode attention: each row's own columns (Triton) | every row over the longest's


@dataclass(frozen=True)
class CacheParams:
    """Target hidden-state cache for train and val conversations."""

    num_feature_layers: int
    layer_ids: Optional[list[int]]  # None: round(1 + i*(L-4)/(n-1)), i < n
    max_train_conversations: Optional[int]
    max_val_conversations: Optional[int]
    batch_tokens: int
    shard_tokens: int
    dtype: Literal["bfloat16", "float16", "float32"]
    compute_dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]]  # the target's dtype for the features; null = target.dtype; auto: precision.py


@dataclass(frozen=True)
class DraftParams:
    """Architecture of the draft (shared by train, export, evaluate). null = as the target."""

    num_layers: int
    block_size: int
    intermediate_size: Optional[int]
    num_attention_heads: Optional[int]
    num_key_value_heads: Optional[int]
    head_dim: Optional[int]
    gru_hidden_dim: int
    emb_dim: int  # rank r of the correction head
    use_domino_head: bool  # false = pure DFlash (ablation / baseline)


@dataclass(frozen=True)
class TrainParams:
    """Curriculum training of the draft with Lightning."""

    features: Literal["cache", "online"]  # online: target features computed in the step
    max_steps: int
    batch_size: int
    group_by_length: bool  # batches of similar lengths (less padding for the target and the draft's context)
    num_anchors: int
    lr: float
    min_lr_ratio: float
    weight_decay: float
    warmup_fraction: float
    grad_clip: float
    loss_gamma: float  # position weights w_k = exp(-k / gamma)
    lambda_decay_fraction: float  # lambda: 1 -> 0 linearly over this fraction of the steps
    loss: Literal["ce", "kd", "tv"]  # ce: hard labels; kd: the target's own next-token distribution; tv: acceptance (online only)
    tv_mix: float  # loss tv: tv_mix * (1 - sum min(p, q)) + (1 - tv_mix) * kd, per slot (train/distill.py)
    tv_temperature: float  # loss tv: the T of p and q in the acceptance term (the sampling T served)
    labels: Literal["data", "target"]  # data: the data's tokens on assistant turns; target: the target's greedy token at every position
    init_from_target: bool  # draft layers start as copies of the target layers after the deepest feature
    loss_vocab: Literal["full", "data", "sampled"]  # data: only tokens the train split supervises; sampled: the step's labels + loss_negatives random tokens (log-corrected)
    loss_negatives: int  # loss_vocab: sampled: uniform negatives per step (>= 1; >= V means the full softmax)
    ce_kernel: Literal["auto", "torch", "triton"]  # the loss's cross-entropy: chunked torch ops, or one fused Triton kernel (dominospec.kernels.cross_entropy); auto = triton on CUDA
    distill_kernel: Literal["auto", "rows", "torch", "triton"]  # loss kd / tv: rows (the reference: recomputed in backward) | torch (value and gradient in one pass) | triton (dominospec.kernels.distill); auto = triton on CUDA, torch elsewhere
    val_every_steps: int
    val_max_sequences: int
    val_walk_tokens: Optional[int]  # the val walk covers each reply's first n tokens (evaluate decodes evaluate.max_new_tokens); null = whole replies
    val_walk_temperature: Optional[float]  # the sampled val walk's T (expected τ under rejection sampling at T); null = greedy walk only
    checkpoint_every_steps: int
    max_minutes: Optional[float]  # stop at this much training wall time (every resumed slice counted), before max_steps; null = steps only
    checkpoint_minutes: Optional[float]  # also save last.ckpt every this many minutes of training wall time; null = off
    walk_minutes: list[float]  # the val walk (greedy and sampled) at these minutes of training wall time -> MLflow, metrics/train_walk.json
    log_every_steps: int
    seed: int
    precision: str  # Lightning precision: 32-true | bf16-mixed | bf16-true | auto (bf16-mixed where bf16 is fast: precision.py)
    accelerator: str  # auto | cpu | gpu
    devices: int
    num_nodes: int
    strategy: str  # auto | ddp | fsdp | ...
    num_workers: int


@dataclass(frozen=True)
class ExportParams:
    """Checkpoint -> the HF draft SGLang serves (bf16) and the ONNX graphs (fp32)."""

    onnx_opset: int  # >= 17


@dataclass(frozen=True)
class TreeParams:
    """What a round of mode `domino` drafts (`dominotree` is `domino` with best_first, whatever `shape` says)."""

    shape: Literal["best_first", "chain"]  # DominoTree (engine.domino_tree) | the draft's one chain
    nodes: int  # best_first: the node budget N, a verify of at most N + 1 rows; auto-K verifies the best n <= N
    children: int  # best_first: children offered per expansion, the path's top-k corrected draft tokens


@dataclass(frozen=True)
class EngineParams:
    """Speed knobs of the built-in engine (evaluate, generate, built-in serve). None changes what is generated."""

    linear: Literal["auto", "packed", "torch"]  # packed: target + draft linears pre-packed for oneDNN (CPU fp32/bf16); auto: the faster one-row forward
    draft_dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]]  # draft path (backbone, base logits, rollout); null = target's; auto: precision.py
    candidate_pool: int  # M top base-logit candidates the rollout scores per block; 0 = the exact full vocabulary
    confidence_cut: float  # verify drafts while the product of their draft probabilities stays >= this; 0 = off
    acceptance_window: int  # auto-K: rounds of acceptance history (exponentially decayed) K follows
    ngram_min: int  # ngram mode (prompt lookup): shortest suffix n-gram looked up
    ngram_max: int  # ngram mode: longest suffix n-gram looked up (tried first)
    ngram_num_draft: int  # ngram mode: most tokens proposed per round
    ngram_assist: bool  # draft modes: verify a prompt-lookup continuation instead of drafting when the context offers one
    ngram_fork: bool  # with ngram_assist, greedy: verify it beside the draft's chain, two branches in one forward
    tree: TreeParams  # the draft tree a Domino round verifies
    head_kernel: Literal["auto", "torch", "triton"]  # Domino rollout: torch ops, or the Triton kernels (dominospec.kernels; CUDA or TRITON_INTERPRET)
    cuda_graphs: Literal["auto", "on", "off", "static"]  # static caches + CUDA graphs for verify, AR step and draft block; auto = on with CUDA; static = the caches, forwards eager
    graph_capacity: int  # rows of the static caches (prompt + new tokens + a block); longer generations run dynamically
    lean_target: Literal["auto", "on", "off"]  # with static caches: the target on the lean decoder (fused Triton ops, its own KV cache); auto = on CUDA where it fits

    def with_tree(self, **changes: Any) -> EngineParams:
        """These params with `changes` to engine.tree's fields (e.g. `shape="chain"`)."""
        return dataclasses.replace(self, tree=dataclasses.replace(self.tree, **changes))


@dataclass(frozen=True)
class EvaluateParams:
    """AR vs head-off vs Domino decoding on prompt suites: speed, acceptance, exact match."""

    suites: list[str]  # "sharegpt" (test split) | "humaneval" | path to a .jsonl of {"prompt"} / {"messages"}
    max_prompts: int  # per suite, in file order
    max_prompt_tokens: int  # rendered prompts longer than this are skipped (and counted)
    max_new_tokens: int
    temperature: float  # 0 = greedy: spec output must then equal AR output
    top_p: float  # 1 = off
    top_k: int  # 0 = off
    num_draft: Union[int, Literal["auto"], None]  # drafts per round, 1..block_size; null = B-1 (SGLang's); auto = auto-K
    seed: int  # sampling seed of prompt i is seed + i, the same for every mode
    stop_strings: list[str]
    num_threads: Optional[int]  # torch CPU threads; null = torch's default
    server_concurrency: int  # `evaluate --server`: requests in flight at the second level (the first is 1)
    sampled_temperature: Optional[float]  # a second pass at this temperature: AR, head off, Domino (and its chain); null = none
    chain_comparison: bool  # with the head and engine.tree.shape best_first: also decode Domino's chain (shape chain), mode `domino_chain`


@dataclass(frozen=True)
class ServeEvalParams:
    """The `serve_eval` stage: `make serve`'s backend started on paths.draft, measured over HTTP (eval.serve_stage)."""

    max_prompts: int  # per suite of evaluate.suites, in file order (the offline evaluation's first prompts)
    max_new_tokens: int  # per request
    startup_timeout_s: float  # the server must answer GET /health within this many seconds of its start
    stop_timeout_s: float  # seconds between SIGTERM and SIGKILL when the server is stopped


@dataclass(frozen=True)
class HeadlineParams:
    """The `headline` stage: a few numbers per suite from eval.json and serve_eval.json (eval.headline)."""

    digits: int  # decimals the numbers are rounded to


@dataclass(frozen=True)
class CardParams:
    """The `card` stage: the exported draft's model card, written after the evaluation it quotes (card.stage)."""

    license: Optional[str]  # the card's Hugging Face `license:` (e.g. apache-2.0); null = none written


@dataclass(frozen=True)
class ServeParams:
    """`dominospec serve` / `make serve`: SGLang on a CUDA host, else the built-in server (same API subset)."""

    host: str
    port: int
    backend: Literal["auto", "sglang", "builtin"]  # auto: sglang when importable, CUDA is available and the target is not a GGUF
    mode: Literal["domino", "dominotree", "dflash", "ar"]  # built-in server only (SGLang serves what the draft's config says)
    num_draft: Union[int, Literal["auto"], None]  # built-in: K drafts per round, 1..block_size; null = B-1; auto = auto-K
    max_queue: int  # built-in: requests waiting for the engine; one more gets 503
    max_body_bytes: int  # built-in: larger request bodies get 413, before parsing
    max_prompt_tokens: int  # built-in: longer prompts (after the chat template) get 400
    max_tokens_limit: int  # built-in: largest max_tokens a request may ask for
    default_max_tokens: int  # built-in: max_tokens when a request gives none
    api_key_env: str  # env var holding the bearer key; set and non-empty = every /v1/* request needs it
    served_model_name: Optional[str]  # the `model` name clients use; null = the target's name
    sglang_args: list[str]  # extra CLI arguments appended to the SGLang command
    num_threads: Optional[int]  # built-in: torch CPU threads; null = torch's default


@dataclass(frozen=True)
class RetrainParams:
    """`dominospec retrain` / `make retrain`: new data snapshot, pipeline, gate, MLflow registry (no DVC stage)."""

    registered_model: str  # MLflow registered model; its alias `champion` is what `make serve` serves
    gate_suite: str  # evaluate suite (name as in eval.json) whose Domino τ gates promotion; must be in evaluate.suites
    tolerance: float  # promote when gate τ >= champion's gate τ - tolerance (and exact match with AR is 1)
    lock_file: str  # one retrain at a time: flock on this file (a dead holder's lock is taken over)
    commands: list[list[str]]  # the data snapshot, then the pipeline (argv each, run in order; each must exit 0)


@dataclass(frozen=True)
class MlflowParams:
    """The one MLflow store every stage logs to."""

    tracking_uri: str
    artifact_location: str
    experiment: str


@dataclass(frozen=True)
class Params:
    """All of params.yaml. `source` is the file it was read from (not a key)."""

    paths: Paths
    target: TargetParams
    prepare: PrepareParams
    regenerate: RegenerateParams
    cache: CacheParams
    draft: DraftParams
    train: TrainParams
    export: ExportParams
    engine: EngineParams
    evaluate: EvaluateParams
    serve_eval: ServeEvalParams
    headline: HeadlineParams
    card: CardParams
    serve: ServeParams
    retrain: RetrainParams
    mlflow: MlflowParams
    source: Path = field(default=Path("params.yaml"), compare=False)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate a params file or a preset -> `Params`; raises `ParamsError` on any problem."""
    path = Path(path)
    params = _build(Params, read_params(path), _label(path), prefix="", skip={"source"})
    return dataclasses.replace(params, source=path)


def read_params(path: str | Path) -> Any:
    """A params file -> its raw YAML mapping, unchecked. A preset (`params/NAME.yaml` beside a params.yaml)
    holds only what differs: it comes back overlaid on that params.yaml, so every key is there."""
    path = Path(path)
    raw = _read_yaml(path)
    base = preset_base(path)
    if base is None:
        return raw
    if not isinstance(raw, dict) or not raw:
        raise ParamsError(f"{_label(path)}: a preset must be a mapping of the keys it changes")
    applied = applied_preset(base)
    if applied not in (None, path.stem):
        raise ParamsError(f"{base}: preset '{applied}' is already applied; restore the default params.yaml "
                          f"(git checkout {base.name}) before taking '{path.stem}'")
    return overlay(_read_yaml(base), raw)


def preset_base(path: Path) -> Optional[Path]:
    """`params/NAME.yaml` -> the params.yaml beside `params/` it overrides; None for a complete params file."""
    base = path.resolve().parent.parent / "params.yaml"
    return base if path.resolve().parent.name == PRESETS and base.is_file() else None


def applied_preset(path: Path) -> Optional[str]:
    """The preset `dominospec preset` wrote into this params.yaml (its first line says so), else None."""
    match = PRESET_STAMP.match(path.read_text(encoding="utf-8"))
    return match.group(1) if match else None


def overlay(base: Any, over: dict[str, Any]) -> Any:
    """Deep-merge `over` into the mapping `base`, in place (and returned): mappings merge key by key, any
    other value (a list included) replaces the base's. An unknown key is added, for the loader to name."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            overlay(base[key], value)
        else:
            base[key] = value
    return base


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except OSError as err:  # a directory, no permission
        raise ParamsError(f"{path}: cannot read the params file: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ParamsError(f"{path}: not UTF-8 text (byte offset {err.start})") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    except RecursionError:
        raise ParamsError(f"{path}: not valid YAML: nested too deeply") from None


def _label(path: Path) -> str:
    """How an error names the file: `params.yaml`, or `params/NAME.yaml (over params.yaml)` for a preset."""
    return path.name if preset_base(path) is None else f"{PRESETS}/{path.name} (over params.yaml)"


def as_flat_dict(params: Params) -> dict[str, Any]:
    """`Params` -> {"section.key": value}, for MLflow params and metrics files."""
    flat: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                if f.name != "source":
                    walk(getattr(obj, f.name), f"{prefix}{f.name}.")
        else:
            flat[prefix[:-1]] = obj

    walk(params, "")
    return flat


def _build(cls: type, raw: Any, fname: str, prefix: str, skip: set[str] = frozenset()) -> Any:
    where = prefix[:-1] or "top level"
    if not isinstance(raw, dict):
        raise ParamsError(f"{fname}: '{where}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    for key in raw:
        if f"{prefix}{key}" in GONE:
            raise ParamsError(f"{fname}: unknown key '{prefix}{key}': {GONE[prefix + key]}")
        if key not in names:
            raise ParamsError(f"{fname}: unknown key '{prefix}{key}'")
    values = {}
    for name in names:
        if name not in raw:
            raise ParamsError(f"{fname}: missing key '{prefix}{name}'")
        values[name] = _check(hints[name], raw[name], fname, f"{prefix}{name}")
    return cls(**values)


def _check(hint: Any, value: Any, fname: str, key: str) -> Any:
    """Validate one value against its annotation; returns the (possibly converted) value."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, fname, prefix=f"{key}.")
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # Optional[X]: X's own message names the offending item
            return _check(inner[0], value, fname, key)
        for arg in inner:
            try:
                return _check(arg, value, fname, key)
            except ParamsError:
                continue
        raise _type_error(fname, key, " or ".join(_name(a) for a in args), value)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            why = RETIRED_VALUES.get((key, value)) if isinstance(value, str) else None
            raise ParamsError(f"{fname}: '{key}' must be one of {list(allowed)}, got {value!r}"
                              + (f" ({why})" if why else ""))
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise _type_error(fname, key, f"list[{_name(item)}]", value)
        return [_check(item, v, fname, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        kt, vt = typing.get_args(hint)
        if not isinstance(value, dict):
            raise _type_error(fname, key, "mapping", value)
        return {_check(kt, k, fname, key): _check(vt, v, fname, f"{key}.{k}") for k, v in value.items()}
    if hint is float:
        # YAML reads `1e-4` as a string and `1` as an int; accept both as floats.
        if isinstance(value, bool):
            raise _type_error(fname, key, "float", value)
        if isinstance(value, int):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _type_error(fname, key, "float", value) from None
        if isinstance(value, float):
            return value
        raise _type_error(fname, key, "float", value)
    if hint is int and isinstance(value, bool):
        raise _type_error(fname, key, "int", value)
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise _type_error(fname, key, _name(hint), value)


def _name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is not None:
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", str(hint))


def _type_error(fname: str, key: str, expected: str, value: Any) -> ParamsError:
    return ParamsError(f"{fname}: '{key}' must be {expected}, got {type(value).__name__} ({value!r})")
