"""What bounds τ: the draft's first drafted token against how sure the target itself is there.

τ is lost at the first drafted token (docs/journal/2026-12-01-draft-quality-study-engine-by-recipe.md). This script asks
whether that is the draft's fault or the target's: over every anchor a of the target's own replies
(the regenerated val split), it puts side by side
    p1      the target's own top-1 probability for x[a+1] (its logits at position a: the token the
            draft's slot 0 must name, greedy),
    right   whether the draft's first token d_1 at anchor a equals x[a+1],
and tabulates the draft's accuracy by bucket of p1. Where the target is unsure (small p1), its
greedy pick hinges on small logit differences computed from features the draft never sees (the
anchor's own), so a draft can match it only by luck; where the target is sure, a good draft
should match it nearly always.

Two checks beside the table: **alignment** (how often d_1 equals x[a], x[a+1] and x[a+2]: an
off-by-one between training and the engine would put the peak elsewhere than x[a+1]) and an
**n-gram baseline** (the most frequent successor of x[a], and of (x[a-1], x[a]) backing off to
it, counted on the replies of the train split): what a draft must beat to have learnt more than
token statistics.

    python benchmarks/studies/tau_bound.py --params params.yaml [--draft artifacts/draft] [--split val] \
        [--max-sequences 24] [--out tau_bound.json]

Prints a markdown table last; CPU or GPU (the target's device).
"""

from __future__ import annotations

import sys

from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_draft, load_target, parser, setup  # noqa: E402
from common.record import draft_record, write_json  # noqa: E402

BUCKETS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001)


@torch.no_grad()
def anchor_records(draft, target, ids: torch.Tensor, loss_mask: torch.Tensor, ngram: "NgramBaseline",
                   chunk: int = 64) -> torch.Tensor:
    """One sequence -> [A, 6] rows (p1, d_1 right, d_1 = x[a], d_1 = x[a+1], d_1 = x[a+2], n-gram right)
    for every anchor of its first reply.
    The per-anchor scoring is train.walk.walk_sequence's loop, kept at slot 0 rather than reduced to
    accepted lengths."""
    from dominospec.cache.features import target_hidden_and_logits
    from dominospec.train.objective import draft_block_logits, make_blocks
    from dominospec.train.walk import reply_spans

    spans = [(s, e) for s, e in reply_spans(loss_mask) if e - s >= 2][:1]
    if not spans:
        return torch.zeros(0, 6)
    s, e = spans[0]
    supervised = torch.zeros_like(loss_mask, dtype=torch.bool)
    supervised[s:e] = True
    ids = ids.to(target.device)
    feats, logits = target_hidden_and_logits(target.model, ids[None], torch.ones_like(ids)[None],
                                             list(draft.config.target_layer_ids))
    rows = []
    for part in torch.arange(s, e - 1).split(chunk):  # anchors with a label x[a+1]
        part = part.to(ids.device)
        blocks = make_blocks(ids[None], supervised[None].to(ids.device), 0, draft.config.block_size,
                             draft.config.mask_token_id, anchors=[part])
        base, final = draft_block_logits(draft, target.embed_tokens, target.lm_head, feats, blocks)
        slot0 = (final if final is not None else base)[0, :, 0]  # [N, V]: d_1 at each anchor
        d1 = slot0.argmax(-1)
        right = (d1 == blocks.labels[0, :, 0]) & blocks.label_mask[0, :, 0]
        p1 = logits[0, part].float().softmax(-1).amax(-1)  # logits[a] predict x[a+1]
        shifted = [(d1 == ids[(part + k).clamp(max=ids.numel() - 1)]).float() for k in (0, 1, 2)]  # d_1 = x[a+k]
        guess = torch.tensor([ngram.guess(int(ids[a - 1]) if a > 0 else -1, int(ids[a])) for a in part.tolist()],
                             device=ids.device)
        rows.append(torch.stack([p1.cpu(), right.float().cpu(), *(x.cpu() for x in shifted),
                                 (guess == ids[part + 1]).float().cpu()], dim=1))
    return torch.cat(rows)


class NgramBaseline:
    """Most frequent successor of (x[t-1], x[t]), backing off to that of x[t]: counted on reply tokens."""

    def __init__(self):
        self.bigram: dict[int, Counter] = defaultdict(Counter)
        self.trigram: dict[tuple[int, int], Counter] = defaultdict(Counter)

    def add(self, ids: list[int], loss_mask: list[bool]) -> None:
        for t in range(1, len(ids) - 1):
            if loss_mask[t + 1]:
                self.bigram[ids[t]][ids[t + 1]] += 1
                self.trigram[ids[t - 1], ids[t]][ids[t + 1]] += 1

    def guess(self, previous: int, current: int) -> int:
        counts = self.trigram.get((previous, current)) or self.bigram.get(current)
        return counts.most_common(1)[0][0] if counts else -1


def table(records: torch.Tensor) -> list[dict]:
    """anchor_records rows [A, 6] (columns 0, 1: p1, right) -> per p1 bucket: share of anchors, draft first-token accuracy."""
    out = []
    for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:]):
        sel = (records[:, 0] >= lo) & (records[:, 0] < hi)
        n = int(sel.sum())
        out.append(dict(p1=f"{lo:.1f}-{min(hi, 1.0):.1f}", anchors=n, share=n / max(1, len(records)),
                        draft_right=float(records[sel, 1].mean()) if n else None))
    return out


def main() -> None:
    from dominospec.draft import draft_dir
    from dominospec.train.datamodule import PreparedSequences

    p = parser(__doc__)
    p.add_argument("--draft", help="draft dir (default: the pipeline's export, else its final checkpoint)")
    p.add_argument("--split", default="val")
    p.add_argument("--max-sequences", type=int, default=24)
    p.add_argument("--out", help="JSON result path")
    args = p.parse_args()
    params = setup(args)
    target = load_target(params)
    source = args.draft or draft_dir(params.paths)
    draft = load_draft(params, target, source)
    data_root = Path(params.paths.regenerated if params.regenerate.enabled else params.paths.prepared)
    seqs = PreparedSequences(data_root, args.split, args.max_sequences)
    ngram = NgramBaseline()
    for item in PreparedSequences(data_root, "train", None):
        ngram.add(item["input_ids"].tolist(), item["loss_mask"].tolist())
    records = torch.cat([anchor_records(draft, target, item["input_ids"], item["loss_mask"], ngram) for item in seqs])
    rows = table(records)
    alignment = {f"d1_equals_x[a{k}]": float(records[:, 2 + i].mean()) for i, k in enumerate(("", "+1", "+2"))}
    result = dict(draft=str(source), draft_sha256=draft_record(source)["draft_sha256"], data=str(data_root), split=args.split, sequences=len(seqs), anchors=len(records),
                  draft_right=float(records[:, 1].mean()), target_p1_mean=float(records[:, 0].mean()), buckets=rows,
                  alignment=alignment, ngram_right=float(records[:, 5].mean()))
    if args.out:
        write_json(args.out, result)
    print(f"{len(seqs)} {args.split} replies of {data_root}, {len(records)} anchors, draft {source}: first drafted "
          f"token right {100 * result['draft_right']:.1f} %, the target's mean top-1 probability {result['target_p1_mean']:.2f}\n")
    print("alignment: d_1 equals " + ", ".join(f"{k[10:]} {100 * v:.1f} %" for k, v in alignment.items())
          + f"; n-gram baseline (train replies) right {100 * result['ngram_right']:.1f} %\n")
    print("| target's top-1 probability | share of anchors | draft's first token right |\n|---|---|---|")
    for r in rows:
        right = "–" if r["draft_right"] is None else f"{100 * r['draft_right']:.1f} %"
        print(f"| {r['p1']} | {100 * r['share']:.1f} % ({r['anchors']}) | {right} |")


if __name__ == "__main__":
    main()
