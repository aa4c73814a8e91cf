"""Where the time of one training step goes on this machine, by phase: the cross-entropy as it was
(fp32 copies of the logits), the chunked one the train stage uses, the loss vocabulary and the
sampled softmax.

One process, the train stage's own pieces (`DraftLitModule`'s objective, bf16 autocast as
`precision: bf16-mixed`, AdamW), the default draft (params `draft:`) and real sequences of the
train split (regenerated when present, else prepared) with random target features of the real
shape (the features' values do not change the cost). The variants alternate step by step, so
all see the same machine load:

    reference  full vocabulary, F.cross_entropy(logits.float()) (the objective before chunked_ce)
    full       full vocabulary, chunked_cross_entropy (train/chunked_ce.py): the same losses
    data       `train.loss_vocab: data`, chunked (a different objective: see docs/journal/2026-12-01-a-cheaper-cpu-training-step.md)
    sampled    `train.loss_vocab: sampled`: the step's labels + train.loss_negatives uniform negatives
    kd, tv     `train.loss: kd` / `tv` (train/distill.py, train.tv_mix, train.tv_temperature): the target's
               whole distribution, full vocabulary, by train.distill_kernel (auto: one fused pass); they need /o
    kd-rows, tv-rows   the same losses by `train.distill_kernel: rows` (the reference, recomputed in backward)

A variant may carry `/o` (online: the target's forward runs in the step, timed as its own phase,
and supervises the blocks with its own tokens, `train.labels: target`, as a GPU preset trains;
else random features of the real shape and the data's tokens), `/bN` (N sequences a step instead of train.batch_size), `/aN` (N anchors a
sequence instead of train.num_anchors), `/lN` (N draft layers) and `/g` (batches grouped by length,
`train.group_by_length`; else random batches, as the stage draws them), e.g. `sampled/b8/a64/l2/g`.
A recipe's step against another's, in one run (the same blocks a step, the anchors amortising the
target's forward and the draft's context over more blocks):

    python benchmarks/train_step.py --variants full/o/b8/a32,full/o/b2/a128,tv/o/b2/a128
 A block is one anchor's B slots; blocks/s is what training
throughput means here (up to batch_size x num_anchors blocks per step: the blocks counted are
those trained, a sequence with fewer valid anchors giving fewer).

    python benchmarks/train_step.py [--params params.yaml] [--steps 8] [--threads 2]
        [--conversations 192] [--variants reference,full,data,sampled/b16]

Prints ms per phase (blocks, backbone, LM head, Domino head, loss, backward, optimiser), blocks/s
and V' (the loss vocabulary's size), then one markdown table.
"""

from __future__ import annotations

import datetime
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from common.cli import load_target, new_draft, parser, setup
from common.record import device_name

PHASES = ("target", "blocks", "backbone", "lm_head", "head", "loss", "backward", "optimizer")
OBJECTIVES = ("reference", "full", "data", "sampled", "kd", "tv", "kd-rows", "tv-rows")
DISTILLING = ("kd", "tv", "kd-rows", "tv-rows")


def train_sequences(params, limit: int) -> list[dict[str, torch.Tensor]]:
    """The first `limit` train sequences (token ids, loss mask) the train stage would see."""
    from dominospec.train.datamodule import PreparedSequences

    root = Path(params.paths.regenerated)
    if not (root / "dataset_dict.json").is_file():
        root = Path(params.paths.prepared)
    data = PreparedSequences(root, "train", limit)
    return [data[i] for i in range(len(data))], str(root)


class Timer:
    def __init__(self):
        self.ms = {p: 0.0 for p in PHASES}
        self.blocks = 0  # blocks trained (a sequence shorter than its anchors gives fewer)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.ms[name] += (time.perf_counter() - start) * 1e3


def parse_variant(name: str, params) -> tuple[str, int, int, int, bool, bool]:
    """`objective[/o][/bN][/aN][/lN][/g]` -> (objective, sequences a step, anchors a sequence, draft
    layers, grouped, online)."""
    objective, *opts = name.split("/")
    shape = {"b": params.train.batch_size, "a": params.train.num_anchors, "l": params.draft.num_layers}
    grouped, online = "g" in opts, "o" in opts
    for opt in (o for o in opts if o not in ("g", "o")):
        if opt[:1] not in shape or not opt[1:].isdigit():
            raise SystemExit(f"error: variant {name!r}: options are /o, /bN, /aN, /lN and /g")
        shape[opt[0]] = int(opt[1:])
    if objective not in OBJECTIVES:
        raise SystemExit(f"error: variant {name!r}: objective must be one of {', '.join(OBJECTIVES)}")
    if objective in DISTILLING and not online:
        raise SystemExit(f"error: variant {name!r}: {objective} distils the target's logits: add /o")
    return objective, shape["b"], shape["a"], shape["l"], grouped, online


def build(params, target, layer_ids, vocab, objective="full", layers=None, anchors=None, online=False):
    """A fresh default draft + DraftLitModule (+ AdamW) on `target`; vocab None = full softmax;
    `online`: the target computes features and labels in the step."""
    import dataclasses

    from dominospec.train.module import DraftLitModule

    draft_p = dataclasses.replace(params.draft, num_layers=layers or params.draft.num_layers)
    train_p = dataclasses.replace(params.train, loss_vocab="sampled" if objective == "sampled" else "full",
                                  num_anchors=anchors or params.train.num_anchors, labels="target" if online else "data",
                                  loss=objective.split("-")[0] if objective in DISTILLING else "ce",
                                  distill_kernel="rows" if objective.endswith("-rows") else params.train.distill_kernel)
    draft = new_draft(params, target, draft_p)
    module = DraftLitModule(draft, target.embed_tokens.weight, target.lm_head.weight, train_p, layer_ids=layer_ids,
                            loss_vocab=vocab, online_target=target.model if online else None)
    return module, torch.optim.AdamW(draft.parameters(), lr=params.train.lr)


def reference_loss(base, final, labels, mask, weights, lam):
    """The objective before chunked_ce: F.cross_entropy on fp32 copies of the logits."""
    def ce(logits):
        V = logits.shape[-1]
        rows = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1), reduction="none")
        w = weights * mask.float()
        return (w * rows.view(labels.shape)).sum() / w.sum().clamp(min=1e-12)

    return (1 - lam) * ce(final) + lam * ce(base)


def step(module, optimizer, batch, timer: Timer, generator, reference: bool = False) -> float:
    """One optimiser step of the train stage's objective, phase by phase -> loss."""
    from dominospec.train.objective import domino_loss, make_blocks
    from dominospec.train.sampled_vocab import sample_vocabulary

    draft, cfg, hp = module.draft, module.draft.config, module.hp
    target_logits = None
    with timer.phase("target"):  # online: the target's forward, as the stage's training_step runs it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if hp.loss in ("kd", "tv"):
                batch["target_hidden"], target_logits = module.features_and_teacher(batch)
                batch["target_next"] = target_logits.argmax(-1)
            elif hp.labels == "target":
                batch["target_hidden"], batch["target_next"] = module.features_and_next(batch)
    with timer.phase("blocks"):
        if hp.labels == "target":
            blocks = module._train_blocks(batch, batch["target_next"])
        else:
            blocks = make_blocks(batch["input_ids"], batch["loss_mask"], module.hp.num_anchors, cfg.block_size,
                                 cfg.mask_token_id, generator)
        sampled = None
        if module.hp.loss_vocab == "sampled":
            sampled = sample_vocabulary(blocks.labels, blocks.label_mask, module.lm_head_weight.shape[0],
                                        module.hp.loss_negatives, generator)
    B, N, Bk = blocks.block_ids.shape
    vocab = module.loss_vocab_ids if sampled is None else sampled.ids
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with timer.phase("backbone"):
            z = draft(module.embed(blocks.block_ids.view(B, N * Bk)), blocks.positions.view(B, N * Bk),
                      target_features=batch["target_hidden"], attention_mask=blocks.attention_mask)
            z = z.view(B * N, Bk, -1)
        with timer.phase("lm_head"):
            if sampled is not None:
                base = torch.nn.functional.linear(z, module.lm_head_weight.index_select(0, vocab).to(z.dtype))
            else:
                base = (module.lm_head if vocab is None else module.loss_lm_head)(z)
        with timer.phase("head"):
            states = draft.gru_states(module.embed(blocks.gru_ids.view(B * N, Bk)))
            final = draft.final_logits(base, z, states, vocab)
    with timer.phase("loss"):
        labels, mask = blocks.labels.view(B * N, Bk), blocks.label_mask.view(B * N, Bk)
        if sampled is not None:
            base, final, labels = sampled.shift(base), sampled.shift(final), sampled.columns(labels)
        elif vocab is not None:
            columns = module.loss_vocab_index[labels]
            labels, mask = columns.clamp(min=0), mask & (columns >= 0)
        if reference:
            loss = reference_loss(base, final, labels, mask, module.slot_weights, lam=0.5)
        else:
            distill = None if target_logits is None else module.distill_term(target_logits, blocks, mask)
            loss, _, _ = domino_loss(base, final, labels, mask, module.slot_weights, lam=0.5, distill=distill)
    with timer.phase("backward"):
        loss.backward()
    with timer.phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(draft.parameters(), module.hp.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    timer.blocks += int(blocks.block_keep.sum())
    return loss.item()


def main() -> None:
    from dominospec.cache.features import resolve_layer_ids
    from dominospec.train.datamodule import StepBatchSampler, collate
    from dominospec.train.objective import loss_vocabulary

    p = parser(__doc__, threads=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant (after one warm-up)")
    p.add_argument("--conversations", type=int, help="train sequences (default: cache.max_train_conversations)")
    p.add_argument("--variants", default="reference,full,data,sampled/b16")
    args = p.parse_args()

    params = setup(args)
    target = load_target(params, device=torch.device("cpu"))
    layer_ids = resolve_layer_ids(params.cache, target.num_layers)
    sequences, source = train_sequences(params, args.conversations or params.cache.max_train_conversations)
    vocab = loss_vocabulary(sequences)
    variants = args.variants.split(",")
    shapes = {v: parse_variant(v, params) for v in variants}  # objective, batch, anchors, layers, grouped, online
    setups = {v: build(params, target, layer_ids, vocab if o == "data" else None, o, layers, anchors, online)
              for v, (o, _, anchors, layers, _, online) in shapes.items()}
    lengths = [len(s["input_ids"]) for s in sequences]
    batches = {v: list(StepBatchSampler(len(sequences), bs, 0, 0, args.steps + 1, lengths=lengths if grouped else None))
               for v, (_, bs, _, _, grouped, _) in shapes.items()}
    timers = {v: Timer() for v in variants}
    feature_dim = len(layer_ids) * target.hidden_size
    for i in range(args.steps + 1):  # step 0 warms up (allocator, oneDNN primitives)
        for v in variants:
            objective = shapes[v][0]
            items = [sequences[j] for j in batches[v][i]]
            batch = collate(items)
            if not shapes[v][5]:  # offline: random features of the real shape
                batch["target_hidden"] = torch.randn(*batch["input_ids"].shape, feature_dim).to(torch.bfloat16)
            timer = timers[v] if i else Timer()
            module, optimizer = setups[v]
            step(module, optimizer, batch, timer, torch.Generator().manual_seed(i), reference=objective == "reference")

    print(f"{datetime.date.today()} {device_name(False)} torch {torch.__version__} "
          f"threads {args.threads}; sequences from {source}; V {target.identity.vocab_size}, V' {vocab.numel()}, "
          f"{params.train.loss_negatives} sampled negatives; B={params.draft.block_size}, {args.steps} steps")
    print("\n| objective | features | sequences | anchors | layers | batches | " + " | ".join(f"{p} ms" for p in PHASES)
          + " | step ms | blocks/s |")
    print("|---|---|---|---|---|---|" + "---|" * (len(PHASES) + 2))
    for v in variants:
        objective, bs, anchors, layers, grouped, online = shapes[v]
        ms = {p: timers[v].ms[p] / args.steps for p in PHASES}
        total = sum(ms.values())
        name = {"reference": f"full vocabulary ({target.identity.vocab_size}), fp32 F.cross_entropy",
                "full": f"full vocabulary ({target.identity.vocab_size}), chunked CE",
                "data": f"loss vocabulary ({vocab.numel()}), chunked CE",
                "sampled": f"sampled ({params.train.loss_negatives} negatives + the step's labels), chunked CE",
                "kd": f"kd, the target's distribution (mix 0, distill_kernel {params.train.distill_kernel})",
                "tv": f"tv (mix {params.train.tv_mix}, T {params.train.tv_temperature}) + kd, distill_kernel "
                      f"{params.train.distill_kernel}",
                "kd-rows": "kd, the target's distribution (mix 0, distill_kernel rows)",
                "tv-rows": f"tv (mix {params.train.tv_mix}, T {params.train.tv_temperature}) + kd, distill_kernel rows",
                }[objective]
        blocks = timers[v].blocks / args.steps  # a step's real blocks, <= bs x anchors
        print(f"| {name} | {'online' if online else 'random'} | {bs} | {anchors} | {layers} | {'by length' if grouped else 'random'} | " + " | ".join(f"{ms[p]:.0f}" for p in PHASES)
              + f" | {total:.0f} | {blocks / total * 1e3:.2f} |")


if __name__ == "__main__":
    main()
