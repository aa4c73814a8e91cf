"""The same decoding, round for round, on two versions of the engine: a restructure's check.

Every draft mode and its switches decode the same prompts on the real target and a trained draft,
in fp32, with K fixed and with auto-K on a fixed cost table (so that auto-K's choices do not follow
the machine's timing). Per mode and prompt the JSON holds what a restructure must not change: the
tokens (a hash), the rounds, the tokens each round emitted, the acceptance by position and the
round counters (lookup, fork, fork won by the lookup, tree, tree won off the first guess).

    git worktree add /tmp/old OLD_COMMIT
    PYTHONPATH=/tmp/old/src python benchmarks/studies/round_identity.py --draft DRAFT --prompts prompt_ids.jsonl --out old.json
    python benchmarks/studies/round_identity.py --draft DRAFT --prompts prompt_ids.jsonl --out new.json
    python benchmarks/studies/round_identity.py --compare old.json new.json

(the old engine from the worktree's `src`, the draft's model and the kernels from this checkout).
Sampled modes are left out: their draws are a function of the acceptance's random stream.
"""

from __future__ import annotations

import sys
from pathlib import Path

import argparse
import dataclasses
import hashlib
import json

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_target, plain_engine  # noqa: E402
from common.prompts import interleave, read_prompts  # noqa: E402

# a fixed round cost (ms): auto-K's choices then depend on the acceptance alone
COST = dict(verify=[10.0 + 0.4 * r for r in range(300)], draft=3.0, rollout_step=0.3, tree_build=2.0)


def modes(base):
    """name -> (mode, num_draft, engine params)."""
    fork = dataclasses.replace(base, ngram_assist=True, ngram_fork=True).with_tree(shape="chain")
    dominotree = dataclasses.replace(base, ngram_assist=True, ngram_fork=True).with_tree(nodes=24)
    return {"ngram": ("ngram", None, base), "dflash": ("dflash", None, base),
            "domino chain": ("domino", None, base.with_tree(shape="chain")),
            "domino chain+fork": ("domino", None, fork),
            "domino assist": ("domino", None, dataclasses.replace(base, ngram_assist=True, ngram_fork=False).with_tree(shape="chain")),
            "dominotree+fork": ("dominotree", None, dominotree), "auto domino chain+fork": ("domino", "auto", fork),
            "auto dominotree+fork": ("dominotree", "auto", dominotree), "auto ngram": ("ngram", "auto", base)}


def decode(args: argparse.Namespace) -> None:
    from dominospec.config import load_params
    from dominospec.engine import SpecEngine
    try:
        from dominospec.draft import load_draft
    except ImportError:  # an engine from before the draft's loader left it (d597559 and older)
        from dominospec.engine import load_draft
    from dominospec.engine.policy import RoundCost

    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    target = load_target(params, None, "float32")
    draft = load_draft(args.draft, target).float()
    plan = interleave({k: v[:args.max_prompts] for k, v in read_prompts(args.prompts).items()})
    out = {}
    for name, (mode, k, opts) in modes(plain_engine(params.engine, head_kernel="torch", candidate_pool=2048)).items():
        engine = SpecEngine(target, None if mode == "ngram" else draft, mode, k, opts)
        if k == "auto":
            engine.cost = RoundCost(**COST)
        rows = []
        for _, prompt in plan:
            s = (g := engine.generate(prompt, args.new_tokens)).stats
            rows.append(dict(tokens=hashlib.sha1(str(g.token_ids).encode()).hexdigest()[:12], rounds=s.rounds,
                             lengths=s.accepted_lengths, by_position=s.position_accepted,
                             counters=[s.lookup_rounds, s.fork_rounds, s.fork_lookup_wins, s.tree_rounds,
                                       s.tree_side_wins]))
        out[name] = rows
        print(f"{name}: {sum(r['rounds'] for r in rows)} rounds", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def compare(old_path: str, new_path: str) -> None:
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    for name, rows in old.items():
        fields = sorted({k for a, b in zip(rows, new.get(name, [])) for k in a if a[k] != b[k]})
        print(f"{name}: " + ("identical" if rows == new.get(name) else f"DIFFERS in {fields}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--draft", help="a trained draft's folder")
    p.add_argument("--prompts", help="JSONL of {prompt_ids, suite} (benchmarks/export_prompts.py)")
    p.add_argument("--max-prompts", type=int, default=3, help="per suite")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = p.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        decode(args)


if __name__ == "__main__":
    main()
