"""Draft-quality study: train candidate recipes under one budget, score each by engine τ.

Two steps, so that the GPU machine needs neither `datasets` nor the hub:

    # here (CPU): the prompts and sequences the study needs, as one compact file
    python benchmarks/draft_study.py pack --params params.yaml --out .carry/study/data.pt

    # on the GPU machine (resumable: finished candidates are kept in --state)
    python benchmarks/draft_study.py run --data data.pt --gguf-dir DIR --state STATE \
        --steps 1000 --budget-seconds 560 [--candidates base,depth2,...]

`run` does, in this order, each step skipped when --state already holds it:
1. regenerate: the target answers the first user turn of the packed train conversations
   (batched greedy HF `generate`, chunks of prompts sorted by length), and of the val split;
2. references: the target's greedy answers to the held-out suites (ShareGPT test, HumanEval);
3. candidates: each trains with the pipeline's own LightningModule (online features, the same
   objective, curriculum and optimiser as the train stage), then is scored by the engine walk
   (src/dominospec/train/walk.py): τ exactly as the engine decodes the target's own greedy
   output, K = B - 1, head on and off, pooled with its standard error over prompts;
4. `combo`: the best value of each factor, trained for --combo-steps, saved as the recipe's draft.
A table (markdown) is printed last and written to STATE/study.md.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from common.cli import load_target, parser, plain_engine, setup
from common.generate import until_stop
from common.prompts import flatten, load_packed, with_answer

# name -> overrides of (draft.*, train.*) and the data ("regen" | "orig", fraction of conversations)
BASE = dict(num_layers=1, block_size=8, loss_gamma=4.0, data="regen", fraction=1.0, loss="ce", init=False,
            labels="data", lr=None, orig=0, loss_vocab="full", batch_size=None)
CANDIDATES: dict[str, dict[str, Any]] = {
    "base": {},
    "depth2": dict(num_layers=2),
    "depth4": dict(num_layers=4),
    "block16": dict(block_size=16, loss_gamma=7.0),
    "orig-data": dict(data="orig"),
    "regen-half": dict(fraction=0.5),
    "kd": dict(loss="kd"),
    "init-target": dict(init=True),
    "steps2x": dict(steps_factor=2.0),
    # The CPU default's question (run with --batch-size 4 --num-anchors 32 --steps 1200 and a pack
    # of 192 regenerated prompts): its 192 replies are memorised (train loss ~1, val loss ~8), so
    # does supervision by the target's own greedy tokens on every position, and on original
    # conversations that need no regeneration, buy τ?
    "target-labels": dict(labels="target"),
    "target-labels+orig1k": dict(labels="target", orig=1000),
    "target-labels+orig3k": dict(labels="target", orig=3000),
    "target-labels+orig3k-lr2e-3": dict(labels="target", orig=3000, lr=2e-3),
    "orig3k-data-labels": dict(orig=3000),
    "target-labels+orig1k-2x": dict(labels="target", orig=1000, steps_factor=2.0),
    "target-labels+orig1k-b4-2x": dict(labels="target", orig=1000, block_size=4, loss_gamma=2.0, steps_factor=2.0),
    # The CPU default as it ships (B = 4, the target's labels; run with --batch-size 4 --num-anchors 32
    # --steps 1600 and a pack of its 256 regenerated prompts), against the sampled softmax
    # (train.loss_vocab: sampled), which makes a CPU step cheap enough for 4x the blocks in the same
    # time (benchmarks/train_step.py), and depth, which costs the CPU step little.
    "cpu": dict(labels="target", block_size=4, loss_gamma=2.0),
    "cpu-sampled": dict(labels="target", block_size=4, loss_gamma=2.0, loss_vocab="sampled"),
    "cpu-sampled-b16": dict(labels="target", block_size=4, loss_gamma=2.0, loss_vocab="sampled", batch_size=16),
    "cpu-sampled-b16-depth2": dict(labels="target", block_size=4, loss_gamma=2.0, loss_vocab="sampled",
                                   batch_size=16, num_layers=2),
    "cpu-sampled-b16+orig1k": dict(labels="target", block_size=4, loss_gamma=2.0, loss_vocab="sampled",
                                   batch_size=16, orig=1000),
    "cpu-depth2": dict(labels="target", block_size=4, loss_gamma=2.0, num_layers=2),
    "cpu-sampled-b8+orig300": dict(labels="target", block_size=4, loss_gamma=2.0, loss_vocab="sampled",
                                   batch_size=8, orig=300),
    "cpu-sampled+orig300": dict(labels="target", block_size=4, loss_gamma=2.0, loss_vocab="sampled", orig=300),
}
FACTORS = {  # factor -> candidates that change it (the base holds the first value)
    "num_layers": ["depth2", "depth4"],
    "block_size": ["block16"],
    "loss": ["kd"],
    "init": ["init-target"],
}


# ---------------------------------------------------------------------------------------------
# pack (CPU, with the prepared dataset)
# ---------------------------------------------------------------------------------------------


def first_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Messages up to and including the first user turn."""
    out = []
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            return out
    return []


def pack(args: argparse.Namespace) -> None:
    from datasets import load_from_disk

    from dominospec.data.chat import render_prompt as render
    from dominospec.eval.prompts import load_suite

    params = setup(args)
    target = load_target(params, device=torch.device("cpu"))
    tok = target.tokenizer
    data = load_from_disk(params.paths.prepared)
    meta = json.loads((Path(params.paths.prepared) / "meta.json").read_text())

    def prompts(split: str, n: int) -> list[torch.Tensor]:
        out = []
        for row in data[split].select(range(min(n, len(data[split])))):
            messages = first_turn(row["messages"])
            ids = render(tok, messages, params.target.chat_template_kwargs) if messages else []
            if 0 < len(ids) <= args.max_prompt_tokens:
                out.append(torch.tensor(ids, dtype=torch.int32))
        return out

    orig = data["train"].select(range(min(args.orig, len(data["train"]))))
    suites = {name: [torch.tensor(p) for p in
                     load_suite(name, tok, params.target.chat_template_kwargs, params.paths.prepared, args.suite_prompts,
                                args.max_prompt_tokens).prompts]
              for name in ("sharegpt", "humaneval")}
    packed = {
        "train_prompts": flatten(prompts("train", args.train)),
        "val_prompts": flatten(prompts("val", args.val)),
        "orig_ids": flatten([torch.tensor(r["input_ids"]) for r in orig]),
        "orig_mask": flatten([torch.tensor(r["loss_mask"], dtype=torch.int64) for r in orig]),
        "suites": {name: flatten(ps) for name, ps in suites.items()},
        "mask_token_id": int(meta["mask_token_id"]),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(packed, args.out)
    sizes = {k: len(v["offsets"]) - 1 for k, v in packed.items() if isinstance(v, dict) and "offsets" in v}
    print(json.dumps({"out": args.out, **sizes, "suites": {k: len(v) for k, v in suites.items()}}))


# ---------------------------------------------------------------------------------------------
# run (GPU)
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_answers(target: Any, prompts: list[torch.Tensor], max_new: int, batch: int, deadline: float,
                   desc: str) -> tuple[list[list[int]], float]:
    """Prompts -> the target's greedy answers (stop token included when emitted), in input order,
    batched in chunks sorted by length; stops starting chunks past `deadline`. -> (answers, tokens/s)."""
    from tqdm import tqdm

    from dominospec.stops import stop_token_ids

    model, tok = target.model, target.tokenizer
    stops = sorted(stop_token_ids(tok, model))
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    answers: list[list[int]] = [None] * len(prompts)  # type: ignore[list-item]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    made, started = 0, time.perf_counter()
    with tqdm(total=len(prompts), desc=desc, unit="prompt") as bar:
        for c in range(0, len(order), batch):
            if time.perf_counter() > deadline:
                break
            rows = order[c:c + batch]
            T = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), T), pad, dtype=torch.long)
            attn = torch.zeros(len(rows), T, dtype=torch.long)
            for r, i in enumerate(rows):  # left padding
                ids[r, T - len(prompts[i]):] = prompts[i].long()
                attn[r, T - len(prompts[i]):] = 1
            out = model.generate(input_ids=ids.to(target.device), attention_mask=attn.to(target.device),
                                 max_new_tokens=max_new, do_sample=False, eos_token_id=stops, pad_token_id=pad)
            for r, i in enumerate(rows):
                answers[i] = until_stop(out[r, T:].tolist(), stops)
                made += len(answers[i])
            bar.update(len(rows))
            bar.set_postfix(tok_s=round(made / (time.perf_counter() - started)))
    return answers, made / max(1e-9, time.perf_counter() - started)


def as_sequences(prompts: list[torch.Tensor], answers: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """(prompt, answer) pairs -> {input_ids, loss_mask on the answer} items (unanswered ones dropped)."""
    return [with_answer(p, a) for p, a in zip(prompts, answers) if a]


def loop_share(answers: list[list[int]], cap: int) -> float:
    """Fraction of answers that hit the token cap without a stop token."""
    done = [a for a in answers if a]
    return sum(len(a) >= cap for a in done) / max(1, len(done))


def train_candidate(params: Any, target: Any, spec: dict[str, Any], items: list[dict], steps: int,
                    mask_token_id: int, layer_ids: list[int]) -> Any:
    """One recipe -> the trained draft (eval mode), through the train stage's LightningModule."""
    import lightning as L

    from dominospec.models.domino import DFlashDraftModel
    from dominospec.train.build import draft_config
    from dominospec.train.datamodule import StepBatchSampler, collate
    from dominospec.train.init import init_from_target
    from dominospec.train.module import DraftLitModule

    draft_p = dataclasses.replace(params.draft, num_layers=spec["num_layers"], block_size=spec["block_size"])
    train_p = dataclasses.replace(params.train, features="online", max_steps=steps, loss=spec["loss"],
                                  loss_gamma=spec["loss_gamma"], init_from_target=spec["init"],
                                  labels=spec["labels"], lr=spec["lr"] or params.train.lr,
                                  loss_vocab=spec["loss_vocab"], batch_size=spec["batch_size"] or params.train.batch_size)
    L.seed_everything(train_p.seed, workers=True)
    draft = DFlashDraftModel(draft_config(draft_p, target, layer_ids, mask_token_id))
    if spec["init"]:
        init_from_target(draft, target.model, layer_ids)
    module = DraftLitModule(draft, target.embed_tokens.weight, target.lm_head.weight, train_p,
                            online_target=target.model, layer_ids=layer_ids)
    sampler = StepBatchSampler(len(items), train_p.batch_size, train_p.seed, 0, steps)
    loader = torch.utils.data.DataLoader(items, batch_sampler=sampler, collate_fn=collate)
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator="auto", devices=1, precision=train_p.precision,
                        gradient_clip_val=train_p.grad_clip, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=True,
                        use_distributed_sampler=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    return module.draft.to(target.device).eval()  # Lightning moves the module back to the CPU after fit


def walk_item(draft: Any, target: Any, item: dict[str, torch.Tensor], heads: tuple[bool, ...]):
    """One (prompt + answer) item -> its engine walk (K = B - 1) for each head setting, one target forward
    (the draft's own target layers)."""
    from dominospec.eval.walk import walk_answer

    return walk_answer(draft, target, item["input_ids"], item["loss_mask"], heads, chunk=256)


def walk_score(draft: Any, target: Any, seqs: list[dict[str, torch.Tensor]], layer_ids: list[int]) -> dict:
    """Engine τ (walk, K = B - 1) on the target's own answers, head on and off."""
    from dominospec.train.walk import WalkStats

    heads = {"domino": WalkStats(), "head_off": WalkStats()}
    for item in seqs:
        on, off = walk_item(draft, target, item, (True, False))
        heads["domino"].merge(on)
        heads["head_off"].merge(off)
    return {name: stats.as_dict() for name, stats in heads.items()}


@torch.no_grad()
def engine_check(draft: Any, target: Any, prompts: list[torch.Tensor], max_new: int, layer_ids: list[int],
                 engine_params: Any) -> dict:
    """The real engine (domino and head off) on `prompts` -> its pooled τ, and the walk's τ on
    the engine's own output: equal up to feature numerics (batched vs incremental forwards)."""
    from dominospec.engine import SpecEngine
    from dominospec.train.walk import WalkStats

    draft = draft.float()
    out: dict[str, Any] = {"prompts": len(prompts)}
    for mode, head in (("domino", True), ("dflash", False)):
        engine, walk = SpecEngine(target, draft, mode, None, engine_params), WalkStats()
        emitted = rounds = 0
        tick = time.perf_counter()
        for p in prompts:
            g = engine.generate(p.tolist(), max_new)
            emitted, rounds = emitted + g.stats.round_tokens, rounds + g.stats.rounds
            walk.merge(walk_item(draft, target, as_sequences([p], [g.token_ids])[0], (head,))[0])
        out[mode] = {"engine_tau": emitted / max(1, rounds), "walk_tau": walk.acceptance_length,
                     "seconds": round(time.perf_counter() - tick, 1)}
    return out


def run(args: argparse.Namespace) -> None:
    from dominospec.target import default_layer_ids

    started = time.perf_counter()
    deadline = started + args.budget_seconds
    torch.set_float32_matmul_precision("high")
    state = Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    params = setup(args)
    params = dataclasses.replace(params, train=dataclasses.replace(
        params.train, batch_size=args.batch_size, num_anchors=args.num_anchors))
    target = load_target(params, args.gguf_dir)
    data = load_packed(args.data)
    layer_ids = default_layer_ids(target.num_layers, params.cache.num_feature_layers)

    gen_path = state / "generated.pt"
    gen = torch.load(gen_path, weights_only=False) if gen_path.is_file() else {}
    for key, prompts, cap in (("suites", None, args.suite_new_tokens), ("val", data["val_prompts"], args.regen_new_tokens),
                              ("train", data["train_prompts"], args.regen_new_tokens)):
        if key in gen:
            continue
        if key == "suites":
            gen[key] = {name: greedy_answers(target, ps, cap, args.gen_batch, float("inf"), name)[0]
                        for name, ps in data["suites"].items()}
        else:
            until = deadline - args.reserve_seconds if key == "train" else float("inf")
            answers, tok_s = greedy_answers(target, prompts, cap, args.gen_batch, until, key)
            gen[key] = answers
            gen[f"{key}_tokens_per_s"] = tok_s
            gen[f"{key}_cap_share"] = loop_share(answers, cap)
        torch.save(gen, gen_path)
    regen = as_sequences(data["train_prompts"], gen["train"])
    orig = [{"input_ids": i.long(), "loss_mask": m} for i, m in data["orig"]]
    evals = {name: as_sequences(data["suites"][name], gen["suites"][name]) for name in data["suites"]}
    evals["val-regen"] = as_sequences(data["val_prompts"], gen["val"])

    results_path = state / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    names = args.candidates.split(",") if args.candidates else list(CANDIDATES) + ["combo"]
    per_step = None
    for name in names:
        if name in results:
            continue
        spec = {**BASE, **(combo_spec(results) if name == "combo" else CANDIDATES[name])}
        steps = args.combo_steps if name == "combo" else int(args.steps * spec.get("steps_factor", 1.0))
        if name == "combo":
            print(json.dumps({"combo": spec}), flush=True)
        if per_step and time.perf_counter() + per_step * steps * spec["num_layers"] ** 0.5 > deadline:
            print(f"study: no time left for {name}; run again to continue", flush=True)
            break
        items = orig if spec["data"] == "orig" else regen[: max(1, int(len(regen) * spec["fraction"]))]
        items = items + orig[: spec["orig"]]
        tick = time.perf_counter()
        draft = train_candidate(params, target, spec, items, steps, data["mask_token_id"], layer_ids)
        fit_s = time.perf_counter() - tick
        per_step = fit_s / steps / spec["num_layers"] ** 0.5
        scores = {suite: walk_score(draft, target, seqs, layer_ids) for suite, seqs in evals.items()}
        results[name] = {"spec": spec, "steps": steps, "conversations": len(items), "fit_s": round(fit_s, 1),
                         "scores": scores}
        results_path.write_text(json.dumps(results, indent=1))
        print(json.dumps({"candidate": name, "fit_s": round(fit_s, 1),
                          **{s: round(v["domino"]["acceptance_length"], 3) for s, v in scores.items()}}), flush=True)
        if name == "combo":  # saved first: the engine check must not be able to lose the trained draft
            copy.deepcopy(draft).to(torch.bfloat16).save_pretrained(state / "combo_draft", max_shard_size="15MB")
            if args.engine_check:
                results[name]["engine_check"] = engine_check(draft, target, data["suites"]["sharegpt"][: args.engine_check],
                                                             args.suite_new_tokens, layer_ids, plain_engine(params.engine))
                results_path.write_text(json.dumps(results, indent=1))
                print(json.dumps(results[name]["engine_check"]), flush=True)
    table = study_table(results, gen, args)
    (state / "study.md").write_text(table)
    print(table)


def combo_spec(results: dict[str, Any]) -> dict[str, Any]:
    """The best value of each factor, by mean engine τ over the held-out suites, vs the base."""
    def score(name: str) -> float:
        s = results[name]["scores"]
        return sum(s[k]["domino"]["acceptance_length"] for k in ("sharegpt", "humaneval")) / 2

    spec: dict[str, Any] = {}
    for factor, names in FACTORS.items():
        best = max(["base"] + [n for n in names if n in results], key=score)
        if best != "base":
            spec[factor] = {**BASE, **CANDIDATES[best]}[factor]
            if factor == "block_size":
                spec["loss_gamma"] = CANDIDATES[best]["loss_gamma"]
    return spec


def study_table(results: dict[str, Any], gen: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"regeneration: {len([a for a in gen.get('train', []) if a])} train answers at "
        f"{gen.get('train_tokens_per_s', 0):.0f} tokens/s, {100 * gen.get('train_cap_share', 0):.0f} % hit the "
        f"{args.regen_new_tokens}-token cap; batch {args.batch_size} sequences x {args.num_anchors} anchors",
        "",
        "| candidate | layers | B | data | conv. | loss | init | steps | fit s | τ ShareGPT | τ HumanEval | "
        "τ head off (ShareGPT / HumanEval) | τ val (regen) | acc. pos 1-4 (ShareGPT) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s, sc = r["spec"], r["scores"]
        tau = lambda k, h="domino": f"{sc[k][h]['acceptance_length']:.2f} ± {sc[k][h]['acceptance_length_se']:.2f}"  # noqa: E731
        acc = " / ".join(f"{a:.2f}" for a in sc["sharegpt"]["domino"]["acceptance_by_position"][:4])
        lines.append(
            f"| {name} | {s['num_layers']} | {s['block_size']} | {s['data']} | {r['conversations']} | {s['loss']} | "
            f"{'yes' if s['init'] else 'no'} | {r['steps']} | {r['fit_s']} | {tau('sharegpt')} | {tau('humaneval')} | "
            f"{sc['sharegpt']['head_off']['acceptance_length']:.2f} / {sc['humaneval']['head_off']['acceptance_length']:.2f} | "
            f"{sc['val-regen']['domino']['acceptance_length']:.2f} | {acc} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    top = parser(__doc__, params=None)
    sub = top.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=12000, help="train conversations whose first turn is regenerated")
    p.add_argument("--orig", type=int, default=3000, help="original (ShareGPT-reply) train sequences")
    p.add_argument("--val", type=int, default=128)
    p.add_argument("--suite-prompts", type=int, default=48)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    r = sub.add_parser("run")
    r.add_argument("--params", default="params.yaml")
    r.add_argument("--data", required=True)
    r.add_argument("--gguf-dir", required=True)
    r.add_argument("--state", required=True)
    r.add_argument("--candidates", default="")
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--combo-steps", type=int, default=2500)
    r.add_argument("--engine-check", type=int, default=8, help="prompts for the real-engine check of the combo")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--num-anchors", type=int, default=128)
    r.add_argument("--budget-seconds", type=float, default=560)
    r.add_argument("--reserve-seconds", type=float, default=300, help="kept for training when regenerating")
    r.add_argument("--gen-batch", type=int, default=512)
    r.add_argument("--regen-new-tokens", type=int, default=256)
    r.add_argument("--suite-new-tokens", type=int, default=128)
    args = top.parse_args()
    pack(args) if args.cmd == "pack" else run(args)


if __name__ == "__main__":
    main()
