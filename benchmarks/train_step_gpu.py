"""Training throughput on a GPU: the train stage's own Lightning loop, variant by variant, in blocks/s.

What a GPU recipe can learn in its budget is blocks seen, so this measures blocks per second of the
real loop: `DraftLitModule` under `lightning.Trainer` (bf16-mixed, AdamW, gradient clipping,
logging as the stage sets it), online features from the target, the target's own labels, as
`params/smollm2-h200.yaml` trains. The target has the SmolLM2-135M-Instruct shapes with random
weights (`--gguf-dir` loads the real one): the values change nothing of the cost. Sequences are
random tokens with lengths drawn like the preset's data (a first user turn and a reply of at most
256 tokens).

    python benchmarks/train_step_gpu.py --params params/smollm2-h200.yaml --steps 40 \
        --variants "preset;batch 16:train.batch_size=16" [--profile] [--out train_step_gpu.json]

The distillation loss's cost (`train.distill_kernel`, docs/training.md), the preset's loss by its fused
kernel against the same loss by rows, against ce and the old preset, in one process:

    --variants "tv;tv rows:train.distill_kernel=rows;kd:train.loss=kd;ce:train.loss=ce;old:train.batch_size=32,train.num_anchors=128,train.loss=ce;tv b4096:distill_block=4096,distill_warps=8"

A variant is `name:key=value,key=value` over params (dotted keys) and the knobs `chunk_rows`,
`cudnn` and `pad` (see `knobs`), `;`-separated. After the
timings, `--profile` runs a few steps of the first variant under torch.profiler and prints the
ops that take the most host and device time. The last thing printed is a markdown table.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from common.cli import load_target, params_with, parser
from common.random_models import SMOLLM2_135M, random_target
from common.record import environment, write_json
from common.train_loop import Sequences, train_steps


KNOBS = ("chunk_rows", "cudnn", "pad", "distill_block", "distill_warps")  # variant keys that are not params (see `knobs`)


@contextmanager
def knobs(overrides: dict[str, str]) -> Iterator[Callable]:
    """The train stage's numerics, changed by the variant's knobs -> the collate function to use.

    chunk_rows=N       CE chunks of N rows (default: `chunked_ce.chunk_rows`, by device)
    cudnn=on           keep cuDNN attention (the stage turns it off: per-shape plans)
    pad=N              pad every batch's length to a multiple of N (few shapes: cuDNN plans reused)
    distill_block=N    the distillation kernel's BLOCK_V (kernels/distill.py; loss kd / tv on CUDA)
    distill_warps=N    its num_warps
    """
    import dominospec.train.chunked_ce as chunked_ce
    from dominospec.train.datamodule import collate
    from dominospec.target import float32_matmul
    from dominospec.train.stage import training_numerics

    saved = chunked_ce.chunk_rows
    if "chunk_rows" in overrides:
        chunked_ce.chunk_rows = lambda logits: int(overrides["chunk_rows"])
    distill_kernel = distill_launch(overrides)
    keep_cudnn = overrides.get("cudnn") == "on"
    multiple = int(overrides.get("pad", 1))

    def padded(items):
        batch = collate(items)
        T = batch["input_ids"].shape[1]
        extra = -T % multiple
        if extra:  # right padding: loss_mask False, lengths unchanged, as collate pads
            batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra))
            batch["loss_mask"] = torch.nn.functional.pad(batch["loss_mask"], (0, extra))
        return batch

    try:
        with float32_matmul("high") if keep_cudnn else training_numerics():  # the stage's, less the cuDNN switch
            yield padded
    finally:
        chunked_ce.chunk_rows = saved
        if distill_kernel is not None:
            distill_kernel.BLOCK_V, distill_kernel.NUM_WARPS = distill_kernel.saved


def distill_launch(overrides: dict[str, str]):
    """The knobs distill_block / distill_warps set on kernels/distill.py -> that module (its old values in
    `.saved`), or None when the variant sets neither (or triton is missing)."""
    if not {"distill_block", "distill_warps"} & overrides.keys():
        return None
    import dominospec.kernels.distill as kernel

    kernel.saved = (kernel.BLOCK_V, kernel.NUM_WARPS)
    kernel.BLOCK_V = int(overrides.get("distill_block", kernel.BLOCK_V))
    kernel.NUM_WARPS = int(overrides.get("distill_warps", kernel.NUM_WARPS))
    return kernel


def run_variant(params, target, steps: int, skip: int, overrides: dict[str, str]) -> dict:
    """Train `steps` steps of the real loop on random sequences -> timings."""
    with knobs(overrides) as collate:  # as the train stage runs it, but for the variant's knobs
        return train_steps(params, target, steps, skip, collate)


def profile(module, params, overrides: dict[str, str], steps: int = 4) -> None:
    """A few steps of `training_step` + backward + AdamW under torch.profiler: top ops."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module.to(device)  # Lightning hands the module back on the CPU after fit
    module.log = lambda *a, **k: None
    optimizer = torch.optim.AdamW(module.draft.parameters(), lr=1e-4)
    module.optimizers = lambda: optimizer
    module.curriculum = lambda: 0.5
    data = Sequences(64, 49152, seed=1)
    bs = params.train.batch_size

    with knobs(overrides) as collate:
        def one(i: int) -> None:
            batch = collate([data[(i * bs + b) % len(data)] for b in range(bs)])
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = module.training_step(batch, i)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.draft.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        one(0)  # warm-up
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            for i in range(1, steps + 1):
                one(i)
            if device.type == "cuda":
                torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))


def main() -> None:
    from transformers import LlamaConfig

    from dominospec.config import load_params

    p = parser(__doc__, params="params/smollm2-h200.yaml")
    p.add_argument("--steps", type=int, default=40, help="steps per variant, the first --skip untimed")
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--variants", default="preset")
    p.add_argument("--gguf-dir", help="load the real target from this dir (default: random weights)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    base = load_params(args.params)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.gguf_dir:
        target = load_target(base, args.gguf_dir, device=device)
    else:
        target = random_target(LlamaConfig(**SMOLLM2_135M), device=device, name="random-smollm2-135m")
    rows = []
    first = None
    for spec in args.variants.split(";"):
        name, _, assignments = spec.partition(":")
        overrides = dict(a.split("=", 1) for a in assignments.split(",") if a)
        params = params_with(args.params, [f"{k}={v}" for k, v in overrides.items() if k not in KNOBS])
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        result = run_variant(params, target, args.steps, args.skip, overrides)
        module = result.pop("module")
        first = first or (module, params, overrides)
        rows.append({"variant": name.strip(), "overrides": overrides, **result})
        print(json.dumps(rows[-1]), flush=True)
    if args.profile and first is not None:
        module, params, overrides = first
        profile(module, params, overrides)
    info = {**environment(), "params": args.params, "rows": rows}
    if args.out:
        write_json(args.out, info)
    print(f"\n{info['date']} {info['device']} torch {info['torch']}; {args.params}; {args.steps} steps, "
          f"first {args.skip} untimed")
    print("| variant | overrides | step ms | blocks/step | blocks/s | peak GiB |\n|---|---|---|---|---|---|")
    for r in rows:
        over = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "(preset)"
        print(f"| {r['variant']} | {over} | {r['step_ms']:.1f} | {r['blocks_per_step']:.0f} | "
              f"{r['blocks_per_s']:.0f} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
