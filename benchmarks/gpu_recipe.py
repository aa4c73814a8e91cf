"""A GPU preset's whole pipeline on a machine without dvc, the hub or the packaged ShareGPT file.

The stages are the pipeline's own functions (prepare -> regenerate -> train -> export -> evaluate),
run in order with the preset's params, so what is measured is what `dvc repro` runs. Two steps:

    # here (CPU, with the prepared dataset): the conversations the preset reads, compact
    python benchmarks/gpu_recipe.py pack --params params/smollm2-h200.yaml --out .carry/recipe

    # on the GPU machine, in slices: each call resumes where the last one stopped
    timeout 560 python benchmarks/gpu_recipe.py run --params params/smollm2-h200.yaml \
        --data .carry/recipe --gguf-dir DIR [--set evaluate.max_prompts=32 ...]

A preset whose target is an HF dir (`params/qwen3-8b.yaml`) takes `--target-dir` (the same option): a
random-weight checkpoint of its shape with its real tokenizer (benchmarks/target_shape.py). Its
`pack --target-dir DIR` first runs the prepare stage on the preset's source with DIR's tokenizer
(the tokenizer alone: a tiny model of the same tokenizer will do), so the packed mask token is
that tokenizer's.

`pack` writes `conversations.jsonl.xz`: the first `regenerate.max_conversations` train conversations,
cut after their first assistant turn when `regenerate.max_turns` is 1 (regenerate reads nothing
after it); with `regenerate.decoder: static` and more turns, cut after the last assistant turn that
starts within prepare's max_length tokens (the prepared row's loss-mask runs: a later turn's prompt
leaves no room for a reply) and the first max_turns; and the whole val and test splits; plus `recipe.json` with the prepared mask token, so
the smaller source picks the token the full one did. Its prepare run then yields the same train
rows in the same order (splits are a function of the id), hence the same regenerate work.

`run` writes `recipe-params.yaml` (the preset, with the target from --gguf-dir, the packed file as
prepare's source, and the --set overrides), then runs each stage whose metrics file is not there
yet. A stage killed part-way resumes by its own means: regenerate from its journal, train from its
last checkpoint. Each stage's wall time and peak GPU memory (allocated and reserved by torch's
allocator: the stages run in this process) are appended to `metrics/recipe_times.json`; the last
line printed is a summary table. Training in slices needs nothing more: with the preset's
`train.checkpoint_minutes` a slice killed outright loses at most that much training, and a slice
ended by `timeout` (SIGTERM) none (train/preempt.py); the val walk's τ at `train.walk_minutes`
(greedy and sampled) is in metrics/train_walk.json and the summary. MLflow logs to a sqlite store under --work; where its dependencies
(sqlalchemy, cryptography) are missing, `--set mlflow.tracking_uri=file:///ABS/mlruns` with
MLFLOW_ALLOW_FILE_STORE=true logs to a file store instead. A GPU image without `datasets` and
`mlflow` takes them as wheels: `pip download --only-binary=:all: --python-version 3.12 --platform
manylinux2014_x86_64 ... datasets==5.2.0 mlflow-skinny==3.17.2` resolves about 16 MB of wheels
once the packages the image already has are dropped (dill, multiprocess, pydantic, fastapi,
opentelemetry, databricks-sdk and gitpython remain), installed there with `pip install --no-deps
--target DIR/site-packages`: the folder's name must hold `site-packages`, or dill (which `datasets`
fingerprints every table with) pickles the packages installed there by value and fails on pyarrow's
`MonthDayNano` ("not found as builtins.MonthDayNano"). Every stage runs in this one process, so each must leave global torch state as it
found it (train and evaluate restore the fp32 matmul precision they set).
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from common.cli import apply_sets
from dominospec.config import read_params

STAGES = ("prepare", "regenerate", "train", "export", "evaluate")
DONE = {  # stage -> the file it writes last (under paths.metrics, or the export dir)
    "prepare": "prepare.json",
    "regenerate": "regenerate.json",
    "train": "train.json",
    "export": None,  # the export dir's model.safetensors
    "evaluate": "eval.json",
}


def answered_turns(messages: list[dict[str, str]], loss_mask: list[int], max_turns: int | None) -> list[dict[str, str]]:
    """Messages up to and including the n-th assistant turn, n = the turns that start within the prepared
    rendering (runs of the loss mask), at most max_turns (None: no cap)."""
    runs = sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))
    n, seen = min(runs, max_turns or runs), 0
    for i, m in enumerate(messages):
        seen += m["role"] == "assistant"
        if seen == n:
            return [dict(x) for x in messages[: i + 1]]
    return [dict(x) for x in messages]


def first_turn_only(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Messages up to and including the first assistant turn (all of them when there is none)."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            return [dict(x) for x in messages[: i + 1]]
    return [dict(x) for x in messages]


def prepared_with(args: argparse.Namespace, work: Path) -> Path:
    """The preset's prepare stage with --target-dir's tokenizer, into `work` -> the prepared dataset."""
    from common.cli import params_with
    from dominospec.data.prepare import prepare

    out = work / "prepared"
    prepare(params_with(args.params, [f"target.model={Path(args.target_dir).resolve()}", "target.gguf_file=null",
                                      f"paths.prepared={out}", f"paths.metrics={work / 'metrics'}"]))
    return out


def pack(args: argparse.Namespace) -> None:
    import tempfile

    from dominospec.config import load_params
    from dominospec.data.dataset import read_dataset

    params = load_params(args.params)
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepared_with(args, Path(tmp)) if args.target_dir else args.prepared or params.paths.prepared
        splits, meta = read_dataset(prepared)
        write_pack(args, params, splits, meta)


def write_pack(args: argparse.Namespace, params: Any, splits: Any, meta: dict) -> None:
    """A prepared dataset's splits -> conversations.jsonl.xz and recipe.json under --out."""
    count = params.regenerate.max_conversations
    cut = params.regenerate.enabled and params.regenerate.max_turns == 1
    answered = params.regenerate.enabled and params.regenerate.decoder == "static" and not cut
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = 0
    with lzma.open(out / "conversations.jsonl.xz", "wt", encoding="utf-8", preset=6) as f:
        for split in ("train", "val", "test"):
            data = splits[split].select_columns(["id", "messages", "loss_mask"])
            if split == "train" and count is not None:
                data = data.select(range(min(count, len(data))))
            for row in data:
                messages = row["messages"]
                if split == "train" and cut:
                    messages = first_turn_only(messages)
                elif split == "train" and answered:
                    messages = answered_turns(messages, row["loss_mask"], params.regenerate.max_turns)
                f.write(json.dumps({"id": row["id"], "messages": messages}, ensure_ascii=False) + "\n")
                rows += 1
    (out / "recipe.json").write_text(json.dumps({"mask_token_id": meta["mask_token_id"], "rows": rows,
                                                 "train_rows": min(count or len(splits["train"]), len(splits["train"])),
                                                 "prepared_meta": meta}, indent=1))
    size = (out / "conversations.jsonl.xz").stat().st_size
    kept = "first turns" if cut else "turns within max_length" if answered else "whole"
    print(f"packed {rows} conversations ({kept} for train): {size / 2**20:.1f} MiB -> {out}")


def recipe_params(args: argparse.Namespace, work: Path) -> Path:
    """The preset with this machine's target, the packed source and the --set overrides -> a params file."""
    raw = read_params(args.params)  # a preset comes back overlaid on params.yaml
    data = Path(args.data)
    source = work / "conversations.jsonl"
    if not source.exists():
        with lzma.open(data / "conversations.jsonl.xz", "rt", encoding="utf-8") as f_in:
            source.write_text(f_in.read(), encoding="utf-8")
    packed = json.loads((data / "recipe.json").read_text())
    raw["target"]["model"] = str(Path(args.target_dir).resolve())
    raw["target"]["mask_token_id"] = packed["mask_token_id"]
    raw["prepare"]["source"] = str(source.resolve())
    # every output under --work: the checkout's tracked metrics/ and plots/ are the CPU default's
    raw["paths"] = {key: str((work / value).resolve()) for key, value in raw["paths"].items()}
    raw["mlflow"]["tracking_uri"] = f"sqlite:///{(work / 'mlflow.db').resolve()}"
    raw["mlflow"]["artifact_location"] = str((work / "mlartifacts").resolve())
    apply_sets(raw, args.set)
    path = work / "recipe-params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def stage_done(params: Any, stage: str) -> bool:
    if stage == "export":
        return (Path(params.paths.draft) / "model.safetensors").exists()
    return (Path(params.paths.metrics) / DONE[stage]).exists()


def run(args: argparse.Namespace) -> None:
    import torch

    from dominospec.config import load_params
    from dominospec.data.prepare import prepare
    from dominospec.regenerate.stage import regenerate
    from dominospec.eval.stage import evaluate
    from dominospec.export.stage import export
    from dominospec.train.stage import train

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    params = load_params(recipe_params(args, work))
    functions = {"prepare": prepare, "regenerate": regenerate, "train": train, "export": export, "evaluate": evaluate}
    times_path = Path(params.paths.metrics) / "recipe_times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else []
    wanted = args.stages.split(",") if args.stages else list(STAGES)
    for stage in STAGES:
        if stage not in wanted or stage_done(params, stage):
            continue
        print(f"== {stage}", flush=True)
        started = time.time()
        times.append({"stage": stage, "started": started, "seconds": None,
                      "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"})
        times_path.parent.mkdir(parents=True, exist_ok=True)
        times_path.write_text(json.dumps(times, indent=1))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the last stage's cached blocks: each stage's reserved peak is its own
            torch.cuda.reset_peak_memory_stats()
        functions[stage](params)
        times[-1]["seconds"] = round(time.time() - started, 1)
        if torch.cuda.is_available():
            times[-1].update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                             peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
        times_path.write_text(json.dumps(times, indent=1))
    summary(params, times)


def summary(params: Any, times: list[dict[str, Any]]) -> None:
    """Seconds per stage (every slice counted; a killed slice counts up to its last record) and the results."""
    per: dict[str, float] = {}
    peak: dict[str, float] = {}
    for t in times:
        per[t["stage"]] = per.get(t["stage"], 0.0) + (t["seconds"] or 0.0)
        peak[t["stage"]] = max(peak.get(t["stage"], 0.0), t.get("peak_reserved_gib") or 0.0)
    metrics = Path(params.paths.metrics)
    print("| stage | seconds (finished slices) | peak GPU GiB (reserved) |\n|---|---|---|")
    for stage, seconds in per.items():
        print(f"| {stage} | {seconds:.0f} | {peak[stage]:.1f} |")
    for name in ("regenerate.json", "train.json"):
        if (metrics / name).exists():
            doc = json.loads((metrics / name).read_text())
            keep = {k: v for k, v in doc.items() if not isinstance(v, (dict, list))}
            print(name, json.dumps(keep))
    if (metrics / "train_walk.json").exists():  # the val walk at train.walk_minutes (train/timed.py)
        print("| minutes | step | sequences | walk τ greedy | walk τ sampled |\n|---|---|---|---|---|")
        for row in json.loads((metrics / "train_walk.json").read_text())["rows"]:
            print(f"| {row['train_minutes']} | {row['step']} | {row['sequences']} | {row['acceptance_length']} "
                  f"| {row['acceptance_length_sampled']} |")
    if (metrics / "eval.json").exists():
        doc = json.loads((metrics / "eval.json").read_text())
        print("| suite | mode | τ ± SE | tokens/s | speed-up | exact |\n|---|---|---|---|---|---|")
        for suite, s in doc["suites"].items():
            for mode, m in s["modes"].items():
                print(f"| {suite} | {mode} | {m['acceptance_length']} ± {m.get('acceptance_length_se')} | "
                      f"{m['tokens_per_s']} | {m['speedup']} | {m['exact_match']} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--params", required=True)
    p.add_argument("--prepared", default=None, help="the prepared dataset (default: the preset's paths.prepared)")
    p.add_argument("--target-dir", default=None, help="an HF dir with the preset's tokenizer: prepare runs first, with it")
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--params", required=True)
    r.add_argument("--data", required=True, help="the folder `pack` wrote")
    r.add_argument("--target-dir", "--gguf-dir", dest="target_dir", required=True,
                   help="the folder holding the preset's target.gguf_file, or (target.gguf_file null) an HF model dir")
    r.add_argument("--work", default="recipe-work", help="where the params file and the unpacked source go")
    r.add_argument("--stages", default=None, help="comma-separated subset of " + ",".join(STAGES))
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args(argv)
    {"pack": pack, "run": run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
