"""A held-out chat suite: ShareGPT test conversations past the README suite's, whose prompt no train row contains.

    python benchmarks/heldout_suite.py [--params params.yaml] --out DIR [--skip 64] [--ids 16]

The prepared dataset's test split is held out of train by conversation id and by prompt
(prepare's `train_prompt_held_out`); the README's `sharegpt` suite takes its first
`evaluate.max_prompts` conversations. This suite takes the first prompts after `--skip` of them,
and keeps a prompt only when its user text, whitespace and case normalised, occurs inside no
message of any train conversation (every turn, the original replies included). The target's own
Magpie prompts are written on the machine that regenerates and are not checked here.
Writes DIR/heldout.jsonl ({"messages"} per line: an `evaluate.suites` entry) and
DIR/heldout_ids.jsonl ({"prompt_ids", "suite": "heldout"}: benchmarks/gpu_engine.py --prompts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from common.cli import load_target, parser, setup, suites
from dominospec.data.dataset import read_dataset
from dominospec.eval.prompts import sharegpt_conversations


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--skip", type=int, default=64, help="test conversations left to the README suite")
    p.add_argument("--ids", type=int, default=16, help="rendered prompts kept")
    p.add_argument("--min-chars", type=int, default=16, help="shorter prompts (greetings) are dropped")
    args = p.parse_args()

    params = setup(args)
    splits, _ = read_dataset(params.paths.prepared)
    train_text = "\n".join(normalised(m["content"]) for row in splits["train"] for m in row["messages"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept, contained = [], 0
    for i, messages in enumerate(sharegpt_conversations(params.paths.prepared)):
        user = normalised(messages[-1]["content"])
        if i < args.skip or len(user) < args.min_chars:
            continue
        if user in train_text:
            contained += 1
            continue
        kept.append(messages)
    path = out / "heldout.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in kept), encoding="utf-8")
    suite = next(suites(params, load_target(params).tokenizer, args.ids, [str(path)]))
    with open(out / "heldout_ids.jsonl", "w") as f:
        for ids in suite.prompts:
            f.write(json.dumps({"prompt_ids": ids, "suite": "heldout"}) + "\n")
    print(f"heldout: {len(kept)} prompts no train row contains ({contained} contained, dropped), "
          f"{len(suite.prompts)} rendered -> {out}")


if __name__ == "__main__":
    main()
