"""One round (docs/design.md §1.5): plan -> draft block -> proposal -> one verify -> acceptance -> commit
-> learn. At its start the target KV holds positions 0..start-1 and x_start sits at `start`; the draft
context plus the features pending for it hold the same rows. The block runs [x_start, MASK x (B-1)] at
start..start+B-1 (pending features appended first) -> z [K, H], u [K, V]; with m tokens committed the
accepted rows move into place, the KV is cropped to start + m, their features pend for the draft.
After every round: target KV length == draft context + pending == prompt + emitted - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dominospec.engine.accept import accept
from dominospec.engine.clock import PhaseClock
from dominospec.engine.ngram import NgramIndex
from dominospec.engine.proposal import Verdict
from dominospec.engine.proposers import Proposer
from dominospec.engine.runner_types import DraftRunner, TargetRunner
from dominospec.engine.sampling import Sampling
from dominospec.engine.stats import GenerationStats


@dataclass(frozen=True)
class Request:
    """What a generation asks of every round: at most `budget` new tokens, drawn by `sampling` (with
    `generator`), ending at any of `stop_ids`."""

    budget: int
    sampling: Sampling
    generator: Optional[torch.Generator]
    stop_ids: frozenset[int]


class RoundState:
    """Per-generation runners: target KV, draft block (its context), features not yet appended to it,
    the context's n-gram index (prompt lookups, engine.ngram) and the rounds' phase clock (engine.clock;
    `events`: the engine's pool of CUDA events)."""

    def __init__(self, kv: TargetRunner, drafter: Optional[DraftRunner], device: torch.device,
                 events: Optional[list] = None):
        self.kv, self.drafter, self.device = kv, drafter, device  # engine.runners' pair
        self.pending: list[torch.Tensor] = []  # [1, rows, n*H] each; drafter.length + rows == kv.length
        self.index: Optional[NgramIndex] = None  # None: no prompt lookups this generation
        self.prompt_length = 0
        self.clock = PhaseClock(device, events)  # the rounds' phase times

    def look_up(self, prompt: list[int], ngram_min: int, ngram_max: int) -> None:
        """Prompt lookups run this generation: the index of the prompt's n-grams (`catch_up` adds the answer's)."""
        self.index = NgramIndex(ngram_min, ngram_max)
        self.index.extend(prompt)
        self.prompt_length = len(prompt)

    def catch_up(self, tokens: list[int]) -> None:
        """The committed tokens `tokens` (after the prompt) -> the n-gram index takes those it has not seen."""
        if self.index is not None:
            self.index.extend(tokens[len(self.index.tokens) - self.prompt_length:])

    def take_pending(self) -> Optional[torch.Tensor]:
        """Pending feature rows -> one tensor [1, S, n*H] (None when there are none), emptied."""
        if not self.pending:
            return None
        features = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)
        self.pending.clear()
        return features

    def flush(self) -> None:
        """Append any pending feature rows to the draft context."""
        features = self.take_pending()
        if features is not None:
            self.drafter.extend(features)


def play_round(proposer: Proposer, state: RoundState, tokens: list[int], start: int, request: Request,
               stats: GenerationStats) -> tuple[int, Optional[str]]:
    """The round (module docstring) at position `start`: `tokens` (committed so far) grows by the m
    tokens committed -> (m, finish reason or None)."""
    sampling, generator = request.sampling, request.generator
    x_start = torch.tensor([tokens[-1]], device=state.device)
    with state.clock.round(stats) as timer:
        plan = proposer.plan(state, request.budget - len(tokens) - 1, sampling.greedy)
        timer.begin(device=plan.drafts > 0)  # drafting rounds queue work the host does not wait for: CUDA events
        with timer.phase("draft"):
            block = state.drafter.block(state.take_pending(), x_start, start, plan.drafts) if plan.drafts else None
        with timer.phase("rollout"):
            proposal = proposer.propose(plan, block, x_start, sampling, generator)
        with timer.phase("verify"):
            ids = torch.cat([x_start, proposal.tokens])
            logits, features = state.kv.forward(ids[None], keep=ids.numel(), tree=proposal.shape)
            with timer.waiting():
                accepted = accept(ids, proposal.parents, proposal.q, logits[0], sampling, generator)
            verdict = Verdict(accepted, features, proposal)
            m, reason = commit(state, tokens, verdict, start, request)
        timer.drafted = plan.drafts > 0 or bool(plan.lookup)
    proposer.learn(plan, verdict, m, stats)
    return m, reason


def commit(state: RoundState, tokens: list[int], verdict: Verdict, start: int,
           request: Request) -> tuple[int, Optional[str]]:
    """The verdict's tokens (stop tokens and the budget admitted) onto `tokens`; the target KV and the
    pending features keep exactly their rows (row 0 first) -> (m, finish reason)."""
    m, reason = admit(tokens, verdict.tokens, request.budget, request.stop_ids)
    tokens += verdict.tokens[:m]
    state.kv.select(verdict.rows[:m])  # a path off the first chain: its rows into place
    state.kv.crop(start + m)  # keep x_start, then the first m-1 accepted tokens
    if verdict.features is not None:
        state.pending.append(verdict.features[:, verdict.rows[:m]])  # the same m rows, for the draft context
    return m, reason


def admit(tokens: list[int], proposed: list[int], budget: int, stop_ids: frozenset[int]) -> tuple[int, Optional[str]]:
    """How many of `proposed` may follow `tokens` within `budget` new tokens -> (count, finish reason or None)."""
    room = budget - len(tokens)
    stop = next((i for i, t in enumerate(proposed[:room]) if t in stop_ids), None)  # the first stop token
    if stop is not None:
        return stop + 1, "stop_token"
    if len(proposed) >= room:
        return room, "length"
    return len(proposed), None
