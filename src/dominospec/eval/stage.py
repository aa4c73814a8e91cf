"""The `evaluate` stage: AR vs prompt lookup vs head-off vs Domino decoding on prompt suites, in one run.

For every prompt of every suite the modes run back to back (AR, ngram, head off, Domino as
configured: DominoTree by default, and with `evaluate.chain_comparison` Domino's chain beside it) with
the same sampling seed, in an order rotated from prompt to prompt, so machine drift hits all alike.
With `evaluate.sampled_temperature` a second pass runs AR, head off and Domino (and its chain) at that
temperature (seeds fixed), each suite's `sampled` entry. All share one target, prepared once
for the `engine:` params (packed linears: the AR baseline gets the verify forward's kernels).
Outputs:

  metrics/eval.json           per suite: τ (pooled, with its standard error over prompts) of each
                              mode, tokens/s, speedup, exact match with AR (greedy), divergences
                              with the target's top-2 margin, acceptance by position, per-round
                              costs; greedy: `walk`, the draft's τ at fixed K = B - 1 on the AR
                              answers (eval.walk: independent of auto-K and machine load);
                              auto-K's measured round cost by K and what it chose; the run's settings
  plots/eval_acceptance/*.csv, plots/eval_tau.csv, plots/eval_*.png   (see eval.plots)
  one MLflow run              params, metrics `<suite>/<key>`, the PNGs and eval.json, tagged
                              with the training run id (`checkpoints/run.json: mlflow_run_id`)

The draft comes from `engine.draft_dir`: the export dir when it holds a draft, else
`checkpoints/final`. With `prompts` (a JSONL file) only that suite runs; with `out` the report
goes there and its plots to `<out stem>_plots/` next to it, leaving the pipeline's outputs alone.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Any, Optional

import torch

from dominospec.errors import UserError
from dominospec.config import EvaluateParams, Params
from dominospec.draft import draft_dir, load_draft
from dominospec.engine import Generation, Sampling, SpecEngine
from dominospec.engine.policy import choose_fork, choose_k
from dominospec.engine.tree_policy import choose_nodes
from dominospec.eval.generate import sampling_from
from dominospec.eval.plots import write_plots
from dominospec.eval.prompts import Suite, load_suite, suite_name
from dominospec.eval.walk import walk_suite
from dominospec.eval.report import CHAIN, HEAD, NGRAM, NO_HEAD, sampled_report, suite_report
from dominospec.runtime.prepare import prepare_target
from dominospec.target import float32_matmul

TAU_DEFINITION = "pooled: tokens emitted by verify rounds (bonus included) / verify rounds; prefill token excluded"


def evaluate(params: Params, prompts: Optional[str] = None, out: Optional[str] = None) -> dict[str, Any]:
    """Params (+ optional prompts JSONL, output path) -> the eval.json document (also written).

    fp32 matmuls run as plain fp32 throughout, whatever this process set before (the train stage
    allows TF32): exact match compares the verify forward with AR, and TF32 turns near-ties into
    divergences."""
    with float32_matmul("highest"):
        return _evaluate(params, prompts, out)


def _evaluate(params: Params, prompts: Optional[str], out: Optional[str]) -> dict[str, Any]:
    from dominospec.files import sha256_file, write_json
    from dominospec.target import load_target

    cfg = params.evaluate
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    sampling = sampling_from(cfg)
    specs = [prompts] if prompts else list(cfg.suites)
    names = [suite_name(s) for s in specs]
    if not specs or len(set(names)) != len(names):
        raise UserError(f"evaluate.suites must name distinct suites, got {specs}")

    target = load_target(params.target)
    source = draft_dir(params.paths)
    draft = load_draft(source, target)
    linear = prepare_target(target, params.engine)  # engine.linear: auto times both kernels here
    options = dataclasses.replace(params.engine, linear=linear)  # the engines' params, engine.linear resolved
    spec_mode = HEAD if draft.config.use_domino_head else NO_HEAD
    ngram_k = cfg.num_draft if cfg.num_draft == "auto" else None  # else params.engine.ngram_num_draft
    # AR gets the same engine options (CUDA graphs on a GPU): the speed-ups are against a fast AR
    engines = {"ar": SpecEngine(target, None, "ar", None, options), NGRAM: SpecEngine(target, None, NGRAM, ngram_k, options),
               NO_HEAD: SpecEngine(target, draft, NO_HEAD, cfg.num_draft, options)}
    if spec_mode == HEAD:
        engines[HEAD] = SpecEngine(target, draft, HEAD, cfg.num_draft, options)
        if cfg.chain_comparison and engines[HEAD].nodes:  # DominoTree's own chain: the head against head off's
            engines[CHAIN] = SpecEngine(target, draft, HEAD, cfg.num_draft, options.with_tree(shape="chain"))
    loaded = [load_suite(s, target.tokenizer, params.target.chat_template_kwargs, params.paths.prepared, cfg.max_prompts,
                         cfg.max_prompt_tokens) for s in specs]
    suites = [s for s in loaded if s.prompts]
    empty = {s.name: f"no prompt of at most {cfg.max_prompt_tokens} tokens ({s.skipped_too_long} longer)"
             for s in loaded if not s.prompts}
    for name, why in empty.items():
        print(f"warning: suite {name!r} skipped: {why}")
    if not suites:
        raise UserError(f"evaluate: every suite is empty: {empty}")

    calibrate_together(engines, spec_mode, suites[0].prompts[0])
    for engine in engines.values():  # first calls allocate and pick kernels: keep them out of the timings
        engine.generate(suites[0].prompts[0], min(8, cfg.max_new_tokens), sampling, seed=cfg.seed)
    report: dict[str, Any] = {
        "suites": {s.name: run_suite(s, engines, spec_mode, sampling, cfg, draft) for s in suites},
        "sampled_temperature": None,
        "empty_suites": empty,
        "spec_mode": spec_mode,
        "device": str(target.device),
        "device_name": device_name(target.device),
        "dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "block_size": int(draft.config.block_size),
        "num_draft": engines[spec_mode].num_draft,  # K_max (auto-K chooses 0..K_max each round)
        "num_draft_setting": cfg.num_draft,
        "engine": dataclasses.asdict(params.engine),
        "linear": linear,  # the kernels the target and draft path ran: engine.linear, auto resolved
        "auto_k": {mode: auto_k_record(engine) for mode, engine in engines.items() if engine.auto},
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "num_threads": torch.get_num_threads(),
        "draft_dir": str(source),
        "draft_sha256": sha256_file(Path(source) / "model.safetensors"),  # which weights: the model card checks it
        "target": target.identity.name,
        "tau": TAU_DEFINITION,
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
    }
    sampled = second_sampling(cfg, sampling) if HEAD in engines else None
    if sampled is not None:  # AR, head off, Domino (and its chain) at the second sampling setting
        report["sampled_temperature"] = sampled.temperature
        modes = {m: engines[m] for m in ("ar", NO_HEAD, HEAD, CHAIN) if m in engines}
        for suite in suites:
            report["suites"][suite.name]["sampled"] = run_sampled(suite, modes, sampled, cfg)
    out_path = Path(out) if out else Path(params.paths.metrics) / "eval.json"
    plots_dir = out_path.parent / f"{out_path.stem}_plots" if out else Path(params.paths.plots)
    write_json(out_path, report)
    pngs = write_plots(report, plots_dir)
    log_run(params, report, [out_path, *pngs])
    for name, suite in report["suites"].items():
        for mode, m in suite["modes"].items():
            print(f"{name} {mode}: τ {_fmt(m['acceptance_length'])} ± {_fmt(m['acceptance_length_se'])}, "
                  f"{_fmt(m['tokens_per_s'])} tok/s, speedup {_fmt(m['speedup'])} ± {_fmt(m['speedup_se'])}, "
                  f"exact match {_fmt(m['exact_match'])}")
        if suite.get("speedup_over_ngram") is not None:
            print(f"{name}: {report['spec_mode']} over ngram {_fmt(suite['speedup_over_ngram'])} "
                  f"± {_fmt(suite['speedup_over_ngram_se'])} (paired by prompt)")
        for mode, m in suite.get("sampled", {}).get("modes", {}).items():
            print(f"{name} {mode} at T = {report['sampled_temperature']}: τ {_fmt(m['acceptance_length'])} ± "
                  f"{_fmt(m['acceptance_length_se'])}, speedup {_fmt(m['speedup'])} ± {_fmt(m['speedup_se'])}")
        for mode, w in suite.get("walk", {}).items():
            if isinstance(w, dict):
                print(f"{name} {mode}: walk τ at K = {suite['walk']['num_draft']} "
                      f"{_fmt(w['acceptance_length'])} ± {_fmt(w['acceptance_length_se'])}")
    return report


TAUS = (1.5, 2.0, 3.0)


def calibrate_together(engines: dict[str, SpecEngine], spec_mode: str, prompt: Any) -> None:
    """Auto-K engines measure their round cost on the first prompt: the draft engine that verifies the
    most rows (the spec mode's on a tie) in full, the others taking its verify and draft forward costs
    and measuring only their own rollout (or tree), so the modes compared prompt by prompt choose their
    shapes from one measurement of the machine."""
    drafting = [e for e in engines.values() if e.auto and e.draft is not None]
    if not drafting:
        return
    lead = max(drafting, key=lambda e: (e.max_verify, e is engines[spec_mode]))
    ids = torch.as_tensor(prompt).reshape(-1).tolist()
    lead.calibrate(ids)
    for engine in engines.values():
        if engine is not lead and engine.auto:
            engine.calibrate(ids, shared=lead.cost)


def auto_k_record(engine: SpecEngine) -> dict[str, Any]:
    """An auto-K engine after the run -> its measured round cost by K, what that cost needs and gives, and
    the K its last acceptance estimate chooses (eval.json `auto_k`)."""
    cost, k_max, models = engine.cost, engine.num_draft, engine.proposer
    survival = models.acceptance.survival()
    over_ar = [cost.round_ms(k) / cost.round_ms(0) for k in range(k_max + 1)]
    record = {
        "cost_ms": cost.as_dict(),  # verify[r-1]: target forward over r rows; draft forward; one chain step
        "round_ms_by_k": [cost.round_ms(k) for k in range(k_max + 1)],
        "round_over_ar_step_by_k": over_ar,  # = the τ a round of K drafts needs to break even
        "speedup_at_tau_k_max": {str(t): t / over_ar[k_max] for t in TAUS},
        "acceptance_estimate_at_end": survival,  # P(>= k drafts accepted), k = 1..K_max, recent rounds
        "k_at_end": choose_k(cost, survival, k_max),
    }
    lookups = models.lookup_acceptance
    if lookups is not None and lookups is not models.acceptance:  # ngram_assist: the lookups' own model
        survival = lookups.survival()
        record["lookup"] = {
            "round_over_ar_step_by_k": [cost.lookup_ms(k) / cost.round_ms(0) for k in range(engine.lookup_k_max + 1)],
            "acceptance_estimate_at_end": survival,
            "k_at_end": choose_k(cost, survival, engine.lookup_k_max, lookup=True),
        }
        if models.fork and not engine.nodes:  # the (K_d, K_l) a full lookup would get now
            record["fork"] = {"k_at_end": list(choose_fork(cost, models.acceptance.survival(), survival, k_max,
                                                           engine.lookup_k_max))}
    if engine.nodes:  # DominoTree: the tree's survival by budget at the end, and the budget it gives
        survival = models.tree_model.survival()
        record["dominotree"] = {"expected_tokens_by_nodes": [1.0 + sum(s) for s in survival],
                                "nodes_at_end": choose_nodes(cost, survival, [], engine.nodes, 0)[0]}
    return record


def second_sampling(cfg: EvaluateParams, sampling: Sampling) -> Optional[Sampling]:
    """evaluate.sampled_temperature -> the second pass's Sampling (top-p, top-k as the first's); None
    when it is off or the same as the first pass."""
    if cfg.sampled_temperature is None:
        return None
    if cfg.sampled_temperature <= 0:
        raise UserError(f"evaluate.sampled_temperature must be > 0 (null = no sampled pass), got {cfg.sampled_temperature}")
    second = Sampling(temperature=cfg.sampled_temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    return None if second == sampling else second


def run_sampled(suite: Suite, engines: dict[str, SpecEngine], sampling: Sampling, cfg: EvaluateParams) -> dict[str, Any]:
    """Every prompt through AR, head off and Domino (and its chain) at `sampling`, interleaved, seed i for prompt i
    -> the suite's `sampled` entry (eval.report.sampled_report)."""
    runs = []
    for i, ids in enumerate(suite.prompts):
        runs.append({mode: engine.generate(ids, cfg.max_new_tokens, sampling, cfg.stop_strings, seed=cfg.seed + i)
                     for mode, engine in rotated(engines, i)})
        print(f"[{suite.name} T={sampling.temperature} {i + 1}/{len(suite.prompts)}] τ "
              f"{_fmt(runs[-1][HEAD].stats.acceptance_length)} (domino), "
              f"{_fmt(runs[-1][NO_HEAD].stats.acceptance_length)} (head off)", flush=True)
    return sampled_report(runs, sampling)


def rotated(engines: dict[str, SpecEngine], i: int) -> list[tuple[str, SpecEngine]]:
    """The modes in the order prompt i runs them: rotated by i, so that no mode always runs first and
    pays alone what a new prompt length costs the first time (kernel and primitive picks)."""
    items = list(engines.items())
    return items[i % len(items):] + items[:i % len(items)]


def run_suite(suite: Suite, engines: dict[str, SpecEngine], spec_mode: str, sampling: Sampling,
              cfg: EvaluateParams, draft: Any) -> dict[str, Any]:
    """Every prompt through every mode, interleaved -> the suite's metrics (greedy: + the walk τ of `draft`)."""
    runs: list[dict[str, Generation]] = []
    for i, ids in enumerate(suite.prompts):
        runs.append({
            mode: engine.generate(ids, cfg.max_new_tokens, sampling, cfg.stop_strings, seed=cfg.seed + i)
            for mode, engine in rotated(engines, i)
        })
        spec = runs[-1][spec_mode].stats
        print(f"[{suite.name} {i + 1}/{len(suite.prompts)}] {spec.new_tokens} tokens, τ {_fmt(spec.acceptance_length)}, "
              f"AR {_fmt(runs[-1]['ar'].stats.tokens_per_s)} vs spec {_fmt(spec.tokens_per_s)} tok/s", flush=True)
    report = suite_report(runs, suite.prompts, spec_mode, sampling.greedy, engines["ar"], suite.skipped_too_long)
    if sampling.greedy:  # the walk drafts greedily: it predicts the engine only for greedy decoding
        report["walk"] = walk_suite(draft, engines["ar"].target, suite.prompts, [r["ar"].token_ids for r in runs])
    return report


def training_run_id(params: Params) -> Optional[str]:
    """MLflow run id the train stage recorded in checkpoints/run.json, if any."""
    record = Path(params.paths.checkpoints) / "run.json"
    if not record.is_file():
        return None
    return json.loads(record.read_text()).get("mlflow_run_id")


def log_run(params: Params, report: dict[str, Any], artifacts: list[Path]) -> None:
    """One MLflow run: params, `<suite>/<metric>` metrics, artifacts, tagged with the training run."""
    import mlflow

    from dominospec.tracking import ensure_experiment, flat_params, run_tags

    experiment = ensure_experiment(params)
    tags = {**run_tags("evaluate"), "training_run_id": training_run_id(params) or "", "draft_dir": report["draft_dir"]}
    metrics = {}
    for suite, entry in report["suites"].items():
        walk = {f"walk/{m}/{k}": v for m, w in entry.get("walk", {}).items() if isinstance(w, dict) for k, v in w.items()}
        sampled = {f"sampled/{mode}/{k}": v for mode, m in entry.get("sampled", {}).get("modes", {}).items()
                   for k, v in m.items()}
        flat = {**entry, **walk, **sampled, **{f"cost_ms/{k}": v for k, v in entry["cost_ms"].items()},
                **{f"{mode}/{k}": v for mode, m in entry["modes"].items() for k, v in m.items()}}
        numeric = {k: v for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics.update({f"{suite}/{k}": float(v) for k, v in numeric.items()})
    with mlflow.start_run(experiment_id=experiment, run_name="evaluate", tags=tags):
        mlflow.log_params(flat_params(params))
        mlflow.log_metrics(metrics)
        for path in artifacts:
            mlflow.log_artifact(str(path))


def device_name(device: torch.device) -> str:
    """Human-readable accelerator or CPU name, for the report."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"
