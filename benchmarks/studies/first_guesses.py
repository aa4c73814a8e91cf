"""What a draft tree of W first guesses is worth to a trained draft: the walk over the target's answers.

For the first N prompts of each suite the target answers greedily (our AR engine); at every
position of the answer the draft's block is scored teacher-forced (train.objective, as the engine
walk of eval.walk does). A tree of W first guesses (engine.draft_head) gets its first token right when
the target's token is among the W most likely of the base logits u_0, and the branch that has it
then goes on as the teacher-forced chain does (greedy drafting: exact). The walk over each answer
(train.walk) then gives τ at K = B - 1 for each W, with the head and without.

A tree may also branch at the second token (`--second`: W x b): each first guess is continued by
the draft's b most likely second tokens after it, W·b chains in all. Its second token is right when
the target's is among those b of the branch with the right first token (the head's corrected slot 1
after that token, teacher-forced: exact for greedy drafting), and that branch goes on as the chain.

    python benchmarks/studies/first_guesses.py [--params params.yaml] [--prompts 8] [--widths 1,2,3,4,6,8] [--second 1,2]

Prints P(target's token among the first W guesses) and walk τ by W (and b), per suite, as a markdown table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_draft, load_target, parser, plain_engine, setup, suites  # noqa: E402
from common.prompts import reply_blocks  # noqa: E402


def walk_tau(items: list, width: int, head: bool, num_draft: int, second: int = 1) -> float:
    """Per-answer scores -> pooled walk τ of a W-guess tree, each guess continued by its `second` best
    second tokens (train.walk's rule: n accepted, n + 1 emitted)."""
    emitted = rounds = 0
    for anchors, rank, right_head, right_base, end, rank2_head, rank2_base, valid in items:
        right = (right_head if head else right_base).clone()
        right[:, 0] = rank < width
        if right.shape[1] > 1:
            right[:, 1] = ((rank2_head if head else rank2_base) < second) & valid[:, 1]
        accepted = dict(zip(anchors.tolist(), right[:, :num_draft].long().cumprod(1).sum(1).tolist()))
        a = int(anchors[0])
        while a < end - 1:
            n = min(accepted[a], num_draft, end - 2 - a)
            emitted, rounds, a = emitted + n + 1, rounds + 1, a + n + 1
    return emitted / rounds


def main() -> None:
    from dominospec.engine import SpecEngine
    from dominospec.train.objective import draft_block_logits

    p = parser(__doc__, threads=2, prompts=8, new_tokens=128)
    p.add_argument("--widths", default="1,2,3,4,6,8")
    p.add_argument("--second", default="1", help="second-token branchings b to try with each W")
    args = p.parse_args()
    params = setup(args)
    target = load_target(params)
    draft = load_draft(params, target)
    K = int(draft.config.block_size) - 1
    ar = SpecEngine(target, None, "ar", None, plain_engine(params.engine))
    widths = [int(w) for w in args.widths.split(",")]
    seconds = [int(b) for b in args.second.split(",")]
    print("| suite | W | b | chains | P(token among W guesses) | walk τ Domino | walk τ head off |\n|---|---|---|---|---|---|---|")
    for suite in suites(params, target.tokenizer, args.prompts):
        items = []
        for prompt in suite.prompts:
            answer = ar.generate(prompt, args.new_tokens).token_ids
            feats, anchors, blocks = reply_blocks(draft, target, prompt, answer)  # every x_start a round may start from
            with torch.no_grad():
                base, final = draft_block_logits(draft, target.embed_tokens, target.lm_head, feats, blocks)
            labels, valid = blocks.labels[0], blocks.label_mask[0]  # [A, B-1]
            gold = base[0, :, 0].gather(1, labels[:, :1])  # [A, 1]: the target's token's base logit at slot 0
            rank = (base[0, :, 0] > gold).sum(1)  # [A]: 0 = the draft's best guess
            # slot 1 after the right first token (teacher-forced): the rank of the target's second token
            rank2 = [(logits[0, :, 1] > logits[0, :, 1].gather(1, labels[:, 1:2])).sum(1) if K > 1
                     else torch.zeros_like(rank) for logits in (final, base)]
            items.append((anchors, rank, (final[0].argmax(-1) == labels) & valid, (base[0].argmax(-1) == labels) & valid,
                          len(prompt) + len(answer), *rank2, valid))
        ranks = torch.cat([item[1] for item in items])
        for w in widths:
            for b in seconds:
                print(f"| {suite.name} | {w} | {b} | {w * b} | {float((ranks < w).float().mean()):.3f} | "
                      f"{walk_tau(items, w, True, K, b):.3f} | {walk_tau(items, w, False, K, b):.3f} |")


if __name__ == "__main__":
    main()
