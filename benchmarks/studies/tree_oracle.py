"""What a best-first draft tree could buy over the engine's first-token tree, at equal verify rows: the walk.

DominoTree (the mission's follow-up) builds its tree best-first over the cumulative draft
log-probability of paths, each expansion scored with that path's own GRU state and the Domino
correction. The engine's tree today takes the W best first tokens and drafts one greedy chain on
from each. Both are scored here the way the engine would experience them, greedily, over the
target's own answers, before any engine work:

- the target answers the first `--prompts` prompts of each suite greedily (our AR engine);
- at each round's x_start of the walk (train.walk's rule: n drafts accepted, n + 1 emitted, the next
  round starts there) the draft's block runs teacher-forced on the target's features, as evaluate's
  walk does, giving z [K, H] and base logits u [K, V];
- `chain`: the head's greedy chain (K drafts, K + 1 verify rows);
- `first W`: the W best first tokens of u_0, each continued by the head's greedy chain (1 + W·K rows);
- `best-first N`: N nodes, each expansion adding the `--children` most likely children of the best
  unexpanded path (log-softmax of u_d + correction(z_d, s_path) over the full vocabulary), depth <= K
  (1 + N rows); `--depth-bonus b` adds b per depth to a path's score (a calibration that favours
  depth). Greedy verification accepts the longest path of the tree that the target's answer follows,
  so n = the depth of the answer's path in the tree.

    python benchmarks/studies/tree_oracle.py --draft DIR [--params params.yaml] [--prompts 16] [--new-tokens 128] \
        [--rows 8,15,29,57] [--children 2,4,8] [--depth-bonus 0,0.5,1,2]

Prints walk τ by policy and verify rows, per suite, as a markdown table. A model of the engine
(teacher-forced features, no auto-K), not an engine measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

import heapq
import itertools

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_draft, load_target, parser, plain_engine, setup, suites  # noqa: E402
from common.prompts import reply_blocks  # noqa: E402


class Anchor:
    """One round's draft outputs at x_start: z [K, H], u [K, V], s_0 [1, G]; the head's logits of a path."""

    def __init__(self, draft, embed, lm_head, z: torch.Tensor, x_start: int):
        self.draft, self.embed, self.z = draft, embed, z
        self.u = lm_head(z).float()  # [K, V]
        self.P = int(draft.config.pure_draft_prefix_len)
        self.s0 = self.step(x_start, z.new_zeros(1, draft.config.gru_hidden_dim))

    def step(self, token: int, state: torch.Tensor) -> torch.Tensor:
        """The GRU state after one more token."""
        return self.draft.gru_step(self.embed(torch.tensor([token])), state)

    def logits(self, depth: int, state: torch.Tensor) -> torch.Tensor:
        """Slot `depth`'s logits after a path of that many drafts (state s_depth) -> [V] fp32."""
        if depth < self.P:
            return self.u[depth]
        return self.u[depth] + self.draft.correction(self.z[depth][None], state)[0].float()


def chain_accepted(anchor: Anchor, labels: list[int], first: int, K: int) -> int:
    """The head's greedy chain from first token `first` -> drafts accepted against `labels`."""
    if first != labels[0]:
        return 0
    n, state = 1, anchor.step(first, anchor.s0)
    for j in range(1, K):
        d = int(anchor.logits(j, state).argmax())
        if d != labels[j]:
            break
        n, state = n + 1, anchor.step(d, state)
    return n


def first_guesses_accepted(anchor: Anchor, labels: list[int], width: int, K: int) -> int:
    """The engine's tree: the W best first tokens of slot 0, each drafted on greedily."""
    firsts = anchor.logits(0, anchor.s0).topk(width).indices.tolist()
    return max(chain_accepted(anchor, labels, f, K) for f in firsts)


def best_first_accepted(anchor: Anchor, labels: list[int], nodes: int, children: int, K: int,
                        bonus: float = 0.0) -> int:
    """A best-first tree of `nodes` nodes -> the depth of the answer's path in it. `bonus` is added to a
    path's score per depth (0: the cumulative log-probability alone; > 0 favours deeper paths)."""
    order = itertools.count()
    frontier: list = []  # (-cumulative log-prob, tie, path, state of the parent)

    def offer(path: tuple, state: torch.Tensor, logp: float) -> None:
        if len(path) >= K:
            return
        lp = F.log_softmax(anchor.logits(len(path), state), dim=-1).topk(children)
        for v, t in zip(lp.values.tolist(), lp.indices.tolist()):
            heapq.heappush(frontier, (-(logp + v + bonus), next(order), path + (t,), state))

    tree: set = set()
    offer((), anchor.s0, 0.0)
    while frontier and len(tree) < nodes:
        neg, _, path, parent = heapq.heappop(frontier)
        tree.add(path)
        offer(path, anchor.step(path[-1], parent), -neg)
    n = 0
    while n < K and tuple(labels[:n + 1]) in tree:
        n += 1
    return n


def walk(answers: list, accepted, K: int) -> float:
    """answers [(ids, start, end, z_of)] -> pooled walk τ with `accepted(anchor, labels)` drafts a round."""
    emitted = rounds = 0
    for ids, start, end, anchor_at in answers:
        a = start
        while a < end - 1:
            labels = (ids[a + 1:a + 1 + K] + [-1] * K)[:K]  # past the answer's end: no token matches
            n = min(accepted(anchor_at(a), labels), K, end - 2 - a)
            emitted, rounds, a = emitted + n + 1, rounds + 1, a + n + 1
    return emitted / rounds


def main() -> None:
    from dominospec.engine import SpecEngine

    p = parser(__doc__, threads=2, prompts=16, new_tokens=128)
    p.add_argument("--draft", required=True, help="a trained draft (HF layout), e.g. the H200 preset's")
    p.add_argument("--rows", default="8,15,29,57", help="verify rows: 1 + W·K of the first-token trees")
    p.add_argument("--children", default="2,4,8", help="best-first: children offered per expansion (each tried)")
    p.add_argument("--depth-bonus", default="0", help="best-first: score bonuses per depth (each tried; 0 = DominoTree's score)")
    args = p.parse_args()
    params = setup(args)
    target = load_target(params)
    draft = load_draft(params, target, args.draft).float()
    K = int(draft.config.block_size) - 1
    embed, lm_head = target.embed_tokens, target.lm_head
    ar = SpecEngine(target, None, "ar", None, plain_engine(params.engine))
    rows = [int(r) for r in args.rows.split(",")]
    children = [int(c) for c in args.children.split(",")]
    bonuses = [float(b) for b in args.depth_bonus.split(",")]
    print("| suite | verify rows | policy | walk τ |\n|---|---|---|---|", flush=True)
    for suite in suites(params, target.tokenizer, args.prompts):
        answers = []
        for prompt in suite.prompts:
            answer = ar.generate(prompt, args.new_tokens).token_ids
            ids = torch.tensor(list(prompt) + answer)
            feats, _, blocks = reply_blocks(draft, target, prompt, answer)
            with torch.no_grad():
                N, Bk = blocks.block_ids.shape[1:]
                z = draft(embed(blocks.block_ids.view(1, N * Bk)), blocks.positions.view(1, N * Bk),
                          target_features=feats.float(), attention_mask=blocks.attention_mask)[0].view(N, Bk, -1)
            cache: dict = {}

            def anchor_at(a: int, z=z, ids=ids, first=len(prompt), cache=cache) -> Anchor:
                if a not in cache:
                    cache[a] = Anchor(draft, embed, lm_head, z[a - first], int(ids[a]))
                return cache[a]
            answers.append((ids.tolist(), len(prompt), ids.numel(), anchor_at))
        with torch.no_grad():
            for r in rows:
                width = (r - 1) // K
                policies = [("chain", lambda an, lb: chain_accepted(an, lb, int(an.logits(0, an.s0).argmax()), K))] \
                    if width <= 1 else [(f"first {width}", lambda an, lb, w=width: first_guesses_accepted(an, lb, w, K))]
                for c, bonus in itertools.product(children, bonuses):
                    name = f"best-first {r - 1}, {c} children" + (f", depth bonus {bonus:g}" if bonus else "")
                    policies.append((name, lambda an, lb, n=r - 1, c=c, b=bonus: best_first_accepted(an, lb, n, c, K, b)))
                for name, accepted in policies:
                    print(f"| {suite.name} | {r} | {name} | {walk(answers, accepted, K):.3f} |", flush=True)


if __name__ == "__main__":
    main()
