"""What one generation produced and cost: `Generation` and its `GenerationStats`.

τ (`acceptance_length`) = tokens emitted by verify rounds ÷ verify rounds, bonus included (the first
token, from the prefill, belongs to no round); a round that verified no draft is a round of 1 token:
τ is what the target forwards after the prefill bought, whatever drafted them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """What one generation cost and how well the draft did."""

    mode: str
    prompt_tokens: int
    num_draft: int  # K_max: the most draft tokens a round may verify (0 in `ar`)
    new_tokens: int = 0
    rounds: int = 0  # target forwards after the prefill: verify rounds (AR steps in `ar`)
    draft_rounds: int = 0  # rounds that ran the drafter (draft forward, or a prompt-lookup hit)
    lookup_rounds: int = 0  # draft modes with ngram_assist: rounds that verified a prompt-lookup continuation instead
    fork_rounds: int = 0  # ngram_fork: rounds that verified a lookup beside the draft's chain (engine.proposers)
    fork_lookup_wins: int = 0  # of those, rounds whose lookup branch accepted more than the chain
    tree_rounds: int = 0  # DominoTree: rounds that verified more than one node
    tree_side_wins: int = 0  # of those, rounds whose accepted path left the draft's best first token
    proposed: int = 0  # draft tokens verified, over all rounds
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per round, bonus included
    # by position: the draft's own chains (ngram_assist's lookups left out, a fork's chain branch in,
    # a tree's best draft branch; in `ngram` its lookups)
    position_accepted: list[int] = field(default_factory=list)  # [K_max] rounds whose draft k+1 was accepted
    position_proposed: list[int] = field(default_factory=list)  # [K_max] rounds that proposed draft k+1
    prefill_s: float = 0.0
    draft_s: float = 0.0  # backbone forwards, base logits, draft-context appends (prompt lookup in `ngram`)
    rollout_s: float = 0.0  # the chain (head rollout, or independent draws with the head off)
    verify_s: float = 0.0  # target forwards after the prefill, acceptance, KV crop
    draft_round_s: float = 0.0  # whole rounds that verified at least one draft (auto-K's plain steps left out)
    total_s: float = 0.0
    # host seconds of the rounds by phase: plan (K, lookups), launch (draft, rollout and verify queued),
    # wait (the acceptance's read of the verify: the host idles while the device finishes), commit
    # (tokens, KV select / crop, features, auto-K's learning); the device idles in plan and commit
    host_s: dict = field(default_factory=dict)
    target_kv_length: int = 0  # at the end: prompt + new_tokens - 1
    draft_context_length: int = 0  # at the end: the same, in draft modes
    static_cache: bool = False  # ran on the static caches (CUDA graphs on a GPU), not the dynamic ones

    def __post_init__(self) -> None:
        self.position_accepted = self.position_accepted or [0] * self.num_draft
        self.position_proposed = self.position_proposed or [0] * self.num_draft

    def record_round(self, proposed: int, emitted: int, chain: tuple[int, int] | None = None) -> None:
        """One round that verified `proposed` tokens (all branches) and emitted `emitted`; `chain` =
        (drafts, accepted) of the draft's own chain, counted by position (None: no chain ran)."""
        self.rounds += 1
        self.draft_rounds += proposed > 0
        self.proposed += proposed
        self.accepted_lengths.append(emitted)
        if chain is None:
            return
        drafts, accepted = chain
        for k in range(drafts):
            self.position_proposed[k] += 1
        for k in range(accepted):
            self.position_accepted[k] += 1

    @property
    def round_tokens(self) -> int:
        """Tokens emitted by verify rounds (all new tokens but the prefill's)."""
        return sum(self.accepted_lengths)

    @property
    def acceptance_length(self) -> float:
        """τ of this generation: round tokens ÷ rounds (nan without rounds)."""
        return self.round_tokens / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """New tokens ÷ wall time of the whole generation (prefill included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")


@dataclass
class Generation:
    """One answer: token ids (stop token included), decoded text (special tokens and any stop
    string cut off), why it ended, and its statistics."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop_token" | "stop_string" | "length" | "abort" (on_tokens returned False)
    stats: GenerationStats
