"""Who proposes a round's tokens, chosen once from the Decoding (`proposer_for`; docs/design.md §1.5):
  plan(state, room, greedy)        -> Plan: K drafts (0: no draft forward), a tree's n nodes, a lookup
  propose(plan, block, x_start, …) -> Proposal (engine.proposal) from the draft block (z, u) and the lookup
  learn(plan, verdict, m, stats)   -> the stats, and auto-K's models (engine.policy, engine.tree_policy)
`LookupSteps` (`ngram`; `ar`, no lookups), `DraftChains` (the draft's chain, cut at `confidence_cut`;
auto-K chooses (K, L) by `choose_fork`, or K) and `BestFirstTrees` (DominoTree's best n nodes, by
`choose_nodes`). A lookup hit replaces the draft or, forking (greedy only: sampled, one proposal a
position), is verified beside it under row 0; the branch accepted furthest wins (the draft on a tie).
Auto-K's models are fresh in every generation (`fresh`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dominospec.engine.decoding import Decoding
from dominospec.engine.policy import AcceptanceModel, RoundCost, choose_fork, choose_k
from dominospec.engine.proposal import Proposal, Verdict, best_first, chains
from dominospec.engine.sampling import Sampling
from dominospec.engine.tree_policy import TreeModel, choose_nodes


@dataclass(frozen=True)
class Plan:
    """What a round proposes from."""

    drafts: int = 0  # K, the block's slots to draft from (0: no draft forward)
    nodes: int = 0  # a tree's n best nodes (0 in a chain round)
    lookup: list[int] = field(default_factory=list)  # the prompt-lookup tokens to verify


class Proposer:
    """The shared part: K_max, lookups, auto-K's models and the measured round cost (`cost`); `head`
    drafts the chains, `grower` grows DominoTree (engine.draft_path)."""

    def __init__(self, decoding: Decoding, device: torch.device, head: Any = None, grower: Any = None):
        d = decoding
        self.num_draft, self.lookup_k_max, self.window, self.auto = d.k_max, d.lookup.k_max, d.window, d.auto
        self.fork, self.device, self.head, self.grower = d.lookup.fork, device, head, grower
        self.confidence_cut, self.nodes = d.cut, d.nodes
        self.cost: Optional[RoundCost] = None  # auto-K: measured by the engine's `calibrate`
        self.fresh()

    def fresh(self) -> None:
        """Auto-K's models, empty: the draft's chains and the lookups (the same model when lookups are the draft)."""
        self.acceptance = AcceptanceModel(self.num_draft, self.window)
        self.lookup_acceptance: Optional[AcceptanceModel] = (AcceptanceModel(self.lookup_k_max, self.window)
                                                              if self.lookup_k_max else None)

    def plan(self, state: Any, room: int, greedy: bool) -> Plan:
        """-> the round's Plan: a lookup alone when it replaces the draft, else the draft's (`plan_draft`)."""
        lookup, fork = self.lookup(state, room, greedy)
        return Plan(lookup=lookup) if lookup and not fork else self.plan_draft(lookup, room)

    def lookup(self, state: Any, room: int, greedy: bool) -> tuple[list[int], bool]:
        """-> (the prompt-lookup tokens this round may verify, [] without a hit or lookups; whether they
        are verified beside the draft (forking, greedy) rather than instead of it)."""
        fork = greedy and self.fork
        if state.index is None:
            return [], fork
        k = self.lookup_k_max if fork else self.choose_k(lookup=True)
        return state.index.propose(min(k, room)), fork

    def choose_k(self, lookup: bool = False) -> int:
        """K_max, or auto-K's choice for the draft's chain or (`lookup`) for a prompt lookup."""
        k_max = self.lookup_k_max if lookup else self.num_draft
        if not self.auto:
            return k_max
        model = self.lookup_acceptance if lookup else self.acceptance
        return choose_k(self.cost, model.survival(), k_max, lookup=lookup)

    def lookup_part(self, plan: Plan) -> list[tuple[str, torch.Tensor]]:
        return [("lookup", torch.tensor(plan.lookup, dtype=torch.long, device=self.device))] if plan.lookup else []

    def learn_lookup(self, verdict: Verdict) -> int:
        """The lookup's model learns its part (or ages) -> the tokens the lookup accepted."""
        parts = verdict.proposal.of("lookup")
        n = len(verdict.path_in(parts[0] if parts else None))
        if self.auto and self.lookup_acceptance is not None and self.lookup_acceptance is not self.acceptance:
            self.lookup_acceptance.update(verdict.proposal.count("lookup"), n)
        return n


class LookupSteps(Proposer):
    """`ngram`: the prompt lookup is the draft (its acceptance is auto-K's one model); `ar`: no lookups, a
    plain target step a round."""

    def fresh(self) -> None:
        super().fresh()
        self.lookup_acceptance = self.acceptance

    def plan(self, state: Any, room: int, greedy: bool) -> Plan:
        return Plan(lookup=self.lookup(state, room, greedy=False)[0])

    def propose(self, plan: Plan, block: Any, x_start: torch.Tensor, sampling: Sampling,
                generator: Optional[torch.Generator]) -> Proposal:
        return chains(self.lookup_part(plan), x_start)

    def learn(self, plan: Plan, verdict: Verdict, m: int, stats: Any) -> None:
        L, n = len(plan.lookup), len(verdict.rows) - 1
        stats.record_round(L, m, chain=(L, n))
        if self.auto:
            self.acceptance.update(L, n)


class DraftChains(Proposer):
    """The draft's chain, and a lookup."""

    def plan_draft(self, lookup: list[int], room: int) -> Plan:
        kd = min(self.num_draft, room)
        if not self.auto:
            return Plan(kd, 0, lookup)
        if not lookup:
            return Plan(min(self.choose_k(), room), 0, [])
        K, L = choose_fork(self.cost, self.acceptance.survival(), self.lookup_acceptance.survival(), kd, len(lookup))
        return Plan(K, 0, lookup[:L])

    def propose(self, plan: Plan, block: Any, x_start: torch.Tensor, sampling: Sampling,
                generator: Optional[torch.Generator]) -> Proposal:
        if block is None:
            return chains(self.lookup_part(plan), x_start)
        z, base_logits = block
        chain = self.head.chain(z, base_logits, x_start, sampling, generator, self.confidence_cut > 0)
        return chains([("draft", chain.tokens[:self.cut(chain)])] + self.lookup_part(plan), x_start, chain.probs)

    def cut(self, chain: Any) -> int:
        """A chain of K drafts -> how many to verify: up to where the product of their draft
        confidences drops below `confidence_cut` (all K when the cut is off)."""
        if self.confidence_cut <= 0 or chain.confidence is None:
            return chain.tokens.shape[0]
        keep = torch.cumprod(chain.confidence.float(), 0) >= self.confidence_cut
        return int(keep.long().cumprod(0).sum())

    def learn(self, plan: Plan, verdict: Verdict, m: int, stats: Any) -> None:
        """By position: the draft's chain; the lookup's own part. Forking, the branch accepted furthest won."""
        drafts = verdict.proposal.of("draft")
        K, L = drafts[0].rows if drafts else 0, verdict.proposal.count("lookup")
        if drafts and L:  # the chain and the lookup beside each other (a forking round)
            n_chain = len(verdict.path_in(drafts[0]))
            stats.fork_rounds += 1
            stats.fork_lookup_wins += verdict.winner().source == "lookup"
        else:
            n_chain = len(verdict.rows) - 1
            stats.lookup_rounds += L > 0
        stats.record_round(K + L, m, chain=(K, n_chain) if K else None)
        self.learn_lookup(verdict)
        if self.auto:
            self.acceptance.update(K, n_chain)


REPLAN_ROUNDS = 4  # auto-budget re-solves DominoTree's plan every this many rounds (its model's window is ~64)


class BestFirstTrees(Proposer):
    """DominoTree's best n nodes, and a lookup. Auto-budget's plan (about 0.15 ms of host time on a GPU
    host) is solved once per REPLAN_ROUNDS rounds and kept for each lookup length seen meanwhile: the
    model moves by a few percent of its window a round, and on a small target the host bounds a round."""

    def fresh(self) -> None:
        super().fresh()
        self.tree_model = TreeModel(self.nodes, self.num_draft, self.window)
        self.plans: dict[int, tuple[int, int]] = {}  # lookup length -> (n, K_l), since the last re-solve
        self.since_solve = 0  # rounds the model has learned since `plans` was cleared

    def plan_draft(self, lookup: list[int], room: int) -> Plan:
        K = min(self.num_draft, room)
        if K == 0:
            return Plan(lookup=lookup)
        if not self.auto or self.tree_model.unseen:  # a generation's first tree is verified whole: it teaches all
            return Plan(K, self.nodes, lookup)
        n, L = self.solved(len(lookup))
        return Plan(K if n else 0, n, lookup[:L])

    def solved(self, kl_max: int) -> tuple[int, int]:
        """Auto-budget's (n, K_l) for a lookup of kl_max tokens, from the plans kept since the last re-solve."""
        if not self.plans:
            self.survival = self.tree_model.survival_array()
        if kl_max not in self.plans:
            lookups = self.lookup_acceptance.survival() if kl_max else []
            self.plans[kl_max] = choose_nodes(self.cost, self.survival, lookups, self.nodes, kl_max)
        return self.plans[kl_max]

    def propose(self, plan: Plan, block: Any, x_start: torch.Tensor, sampling: Sampling,
                generator: Optional[torch.Generator]) -> Proposal:
        lookup = self.lookup_part(plan)
        if block is None:
            return chains(lookup, x_start)
        tree = self.grower.grow(*block, x_start, sampling)
        return best_first(tree, min(plan.nodes, tree.size), lookup[0][1] if lookup else None)

    def learn(self, plan: Plan, verdict: Verdict, m: int, stats: Any) -> None:
        K, L, n = plan.drafts, len(plan.lookup), verdict.proposal.count("tree")
        parts = verdict.proposal.of("tree")
        path = verdict.path_in(parts[0] if parts else None)  # the tree's verify rows on its accepted path (1..n)
        winner = verdict.winner()
        stats.record_round(n + L, m, chain=(K, len(path)) if K else None)
        stats.tree_rounds += n > 1
        stats.tree_side_wins += bool(path) and path[0] != 1  # the path left the draft's best first token
        stats.lookup_rounds += L > 0 and not K
        stats.fork_rounds += L > 0 and K > 0
        stats.fork_lookup_wins += L > 0 and K > 0 and winner is not None and winner.source == "lookup"
        self.learn_lookup(verdict)
        if self.auto:
            self.tree_model.update(n, [(r - 1, depth) for depth, r in enumerate(path, start=1)])
            self.acceptance.update(K, len(path))
            self.since_solve += 1
            if self.since_solve >= REPLAN_ROUNDS:
                self.plans.clear()
                self.since_solve = 0


def proposer_for(decoding: Decoding, head: Any, grower: Any, device: torch.device, sampled: bool = False) -> Proposer:
    """The engine's proposer for greedy (or `sampled`) requests, chosen once from its Decoding
    (engine.decoding): DominoTree's build (engine.draft_path) unless a sampled `domino` drafts the
    head's chain, the head's chain, or the lookup alone (none: plain steps)."""
    d = decoding
    if d.tree and not (sampled and d.sampled_chain):
        return BestFirstTrees(d, device, head, grower)
    return (DraftChains if d.drafting else LookupSteps)(d, device, head, grower)
