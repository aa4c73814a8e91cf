"""Train the draft under several recipes in one process and print a table of validation τ.

For a GPU machine without MLflow or DVC: it calls the train stage's pieces directly
(`build_training` + a Lightning Trainer without logger or checkpoints), with `train.features:
online` (target features computed in the step, no cache on disk). Each recipe overrides
`train.*` keys of the params file; the last one may be sized to a time budget.

    python benchmarks/studies/train_recipes.py --params P.yaml --recipes cpu-default,lr-2e-3 \
        [--long-seconds 470 --save-draft OUT/draft]

Recipes (600 steps x 4 sequences x 32 anchors on 250 conversations is the CPU default):
  cpu-default         the embedded default's training budget
  lr-2e-3             the same at lr 2e-3
  init-target         the same, the draft layer initialised from the target layer after the
                      deepest feature layer (fc selects that feature; an experiment, not a param)
  init-target-lr-2e-3 both
  gpu-scale           8 sequences x 128 anchors over 6,000 conversations, as many steps as
                      --long-seconds allows (measured on a 40-step probe first)
  gamma-1, gamma-4    cpu-default with the position weights w_k = exp(-k / gamma) at gamma 1 / 4
                      (train.loss_gamma; the default's is params.yaml's)
  kd, tv              cpu-default with train.loss kd / tv (the acceptance loss mixed with kd,
                      train.tv_mix, train.tv_temperature)

Every row reports the val walk's τ greedy and sampled at --temperature (train.val_walk_temperature):
the loss and the weighting are chosen by both (docs/training.md). `--steps N` caps every recipe's
steps (a short comparison).

Variants of a params file instead of the fixed recipes, each trained for the same wall time (its
steps sized by a probe of --probe-steps, so a dearer loss trains fewer steps, as it would in a
budgeted run), e.g. the loss on a GPU preset:

    python benchmarks/studies/train_recipes.py --params params/smollm2-h200.yaml --seconds 300 \
        --variants "ce:train.loss=ce;kd:train.loss=kd;tv:train.loss=tv;tv-only:train.loss=tv,train.tv_mix=1"

A variant is `name:section.key=value,...` (`;`-separated) over --params; batch, anchors, lr and the
loss come from its params, the features are online, --conversations caps the train sequences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import dataclasses
import json
import time
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common import cli  # noqa: E402

RECIPES: dict[str, dict[str, Any]] = {
    "cpu-default": dict(max_steps=600, batch_size=4, num_anchors=32, lr=6e-4, limit=250),
    "lr-2e-3": dict(max_steps=600, batch_size=4, num_anchors=32, lr=2e-3, limit=250),
    "init-target": dict(max_steps=600, batch_size=4, num_anchors=32, lr=6e-4, limit=250, init=True),
    "init-target-lr-2e-3": dict(max_steps=600, batch_size=4, num_anchors=32, lr=2e-3, limit=250, init=True),
    "gpu-scale": dict(max_steps=None, batch_size=8, num_anchors=128, lr=6e-4, limit=6000),
    "gamma-1": dict(max_steps=600, batch_size=4, num_anchors=32, lr=6e-4, limit=250, train=dict(loss_gamma=1.0)),
    "gamma-4": dict(max_steps=600, batch_size=4, num_anchors=32, lr=6e-4, limit=250, train=dict(loss_gamma=4.0)),
    "kd": dict(max_steps=600, batch_size=4, num_anchors=32, lr=6e-4, limit=250, train=dict(loss="kd", loss_vocab="full")),
    "tv": dict(max_steps=600, batch_size=4, num_anchors=32, lr=6e-4, limit=250, train=dict(loss="tv", loss_vocab="full")),
}


def init_from_target(setup: Any) -> None:
    """Draft layer 0 <- the target layer that consumes the deepest cached feature; fc selects
    that feature, hidden_norm takes that layer's input norm, the final norm the target's."""
    draft, target = setup.module.draft, setup.target.model.model
    source = target.layers[setup.module.layer_ids[-1] + 1]
    layer = draft.layers[0]
    H = draft.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
        layer.input_layernorm.weight.copy_(source.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        draft.norm.weight.copy_(target.norm.weight)
        draft.fc.weight.zero_()
        draft.fc.weight[:, -H:] = torch.eye(H)
        draft.hidden_norm.weight.copy_(source.input_layernorm.weight)


def train_once(params: Any, steps: int, recipe: dict[str, Any], accelerator: str,
               temperature: float = 0.7, validate: bool = True) -> tuple[dict[str, Any], Any, float]:
    """-> (validation summary, trained setup, seconds of fit); the val walk also sampled at `temperature`;
    without `validate` (a probe that times the steps) no validation runs and the summary is empty."""
    import lightning as L

    from dominospec.precision import resolve_precision
    from dominospec.train.build import build_training

    train = dataclasses.replace(params.train, features="online", max_steps=steps, batch_size=recipe["batch_size"],
                                num_anchors=recipe["num_anchors"], lr=recipe["lr"], val_every_steps=steps,
                                checkpoint_every_steps=10**9, val_walk_temperature=temperature,
                                **recipe.get("train", {}))
    run_params = dataclasses.replace(params, train=train)
    L.seed_everything(train.seed, workers=True)
    setup = build_training(run_params, train_limit=recipe["limit"])
    if recipe.get("init"):
        init_from_target(setup)
    precision = resolve_precision(train.precision, accelerator)
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator=accelerator, devices=1, precision=precision,
                        gradient_clip_val=train.grad_clip, val_check_interval=steps, check_val_every_n_epoch=None,
                        num_sanity_val_steps=0, limit_val_batches=1.0 if validate else 0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, use_distributed_sampler=False,
                        enable_model_summary=False)
    started = time.perf_counter()
    trainer.fit(setup.module, datamodule=setup.datamodule)
    return setup.module.final_validation(), setup, time.perf_counter() - started


def variant_recipes(path: str, spec: str, conversations: int | None) -> list[tuple[str, Any, dict[str, Any]]]:
    """--variants "name:key=value,...;..." over the params at `path` -> [(name, params, recipe)], the
    recipe (steps sized later) taking batch, anchors and lr from the variant's params."""
    rows = []
    for part in (p for p in spec.split(";") if p.strip()):
        name, _, assignments = part.partition(":")
        params = cli.params_with(path, [a for a in assignments.split(",") if a])
        t = params.train
        rows.append((name.strip(), params, dict(max_steps=None, batch_size=t.batch_size, num_anchors=t.num_anchors,
                                                 lr=t.lr, limit=conversations, train={})))
    return rows


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--recipes", default="cpu-default,lr-2e-3,init-target,init-target-lr-2e-3")
    p.add_argument("--long-seconds", type=float, default=300.0, help="time budget of a recipe without max_steps")
    p.add_argument("--save-draft", help="save the last recipe's draft here (bf16, shards <= 15 MB)")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--temperature", type=float, default=0.7, help="the sampled val walk's T")
    p.add_argument("--steps", type=int, help="cap every recipe's steps (a short comparison)")
    p.add_argument("--variants", help="name:section.key=value,...;... over --params, instead of --recipes")
    p.add_argument("--seconds", type=float, help="train every recipe / variant for this wall time (a probe sizes its steps)")
    p.add_argument("--probe-steps", type=int, default=40, help="steps of the probe that sizes a timed run")
    p.add_argument("--conversations", type=int, help="--variants: at most this many train sequences")
    args = p.parse_args()
    torch.set_float32_matmul_precision("high")
    params = cli.setup(args)
    if args.variants:
        runs = variant_recipes(args.params, args.variants, args.conversations)
    else:
        runs = [(name, params, RECIPES[name]) for name in args.recipes.split(",")]
    rows = []
    for name, params, recipe in runs:
        steps = recipe["max_steps"]
        budget = args.seconds or (args.long_seconds if steps is None else None)
        if budget:  # size the run to the budget from a short probe
            _, _, probe_s = train_once(params, args.probe_steps, recipe, args.accelerator, args.temperature,
                                       validate=False)
            steps = max(1, int(min(20_000, budget / (probe_s / args.probe_steps))))
        steps = min(steps, args.steps or steps)
        summary, setup, seconds = train_once(params, steps, recipe, args.accelerator, args.temperature)
        sampled = summary.get("walk_sampled", {})
        row = dict(recipe=name, steps=steps, seqs_x_anchors=f"{recipe['batch_size']}x{recipe['num_anchors']}",
                   lr=recipe["lr"], conversations=recipe["limit"], fit_s=round(seconds, 1),
                   loss=setup.module.hp.loss,
                   tau=round(summary["acceptance_length"], 3), tau_head_off=round(summary["acceptance_length_base"], 3),
                   accuracy_pos1_4=[round(a, 3) for a in summary["accuracy_by_position"][:4]],
                   val_loss=round(summary["loss"], 3), walk=round(summary["walk"]["acceptance_length"], 3),
                   walk_se=round(summary["walk"]["acceptance_length_se"], 3),
                   walk_sampled=round(sampled.get("acceptance_length", float("nan")), 3),
                   walk_sampled_se=round(sampled.get("acceptance_length_se", float("nan")), 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.save_draft:
        setup.module.draft.to(torch.bfloat16).save_pretrained(args.save_draft, max_shard_size="15MB")
    print(f"| recipe | steps | seqs x anchors | lr | conversations | fit s | val τ | val τ head off | accuracy pos 1-4 "
          f"| walk τ greedy | walk τ sampled T {args.temperature} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['steps']} | {r['seqs_x_anchors']} | {r['lr']} | {r['conversations']} | "
              f"{r['fit_s']} | {r['tau']} | {r['tau_head_off']} | {r['accuracy_pos1_4']} "
              f"| {r['walk']} ± {r['walk_se']} | {r['walk_sampled']} ± {r['walk_sampled_se']} |")


if __name__ == "__main__":
    main()
