"""Speculative decoding with a Domino / DFlash draft, batch size 1, and the AR baseline.

One `SpecEngine` per (target, draft, mode):

- `ar`: plain autoregressive decoding, one target forward per token (the baseline).
- `dflash`: the draft backbone proposes a block, each draft token an independent draw from the
  base logits u (head off).
- `domino`: the same block, drafted by the Domino rollout (GRU-corrected logits u + delta).

A round (spec modes). `start` is the position of the last committed token x_start, which has no
target KV yet; at the start of every round the target KV and the draft context both hold exactly
positions 0..start-1 (invariant checked).
  1. draft forward over `[x_start, MASK x (B-1)]` at positions start..start+B-1 -> z [B, H];
     base logits u = target lm_head(z[:K]) [K, V]. K defaults to B-1, SGLang's convention with
     `--speculative-num-draft-tokens B` (a verify forward is exactly B tokens, so the τ measured
     here is the τ SGLang serves); any K in 1..B may be chosen (slot j predicts x[start+1+j],
     so B slots give B drafts). Near the token budget K shrinks to what can still be emitted.
  2. rollout -> d_1..d_K (+ the distributions q they were drawn from, when sampling).
  3. verify: one target forward over [x_start, d_1..d_K] (positions start..start+K) with hidden
     states; acceptance (greedy match, or lossless speculative sampling) commits
     d_1..d_n + one target token.
  4. bookkeeping: with m tokens committed, the target KV is cropped to start+m (keeping x_start,
     d_1..d_{m-1}) and the target features of exactly those m rows are appended to the draft
     context; start += m.
So after every round: target KV length == draft context length == prompt + emitted - 1.

τ (`acceptance_length`) = tokens emitted by verify rounds ÷ verify rounds, bonus included; the
first token, sampled from the prefill, belongs to no round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from transformers import DynamicCache

from dominospec.cli import UserError
from dominospec.engine.kv import cache_argument, crop_kv, kv_length
from dominospec.engine.loading import check_draft_matches
from dominospec.engine.sampling import Sampling, accept_greedy, accept_sampled
from dominospec.engine.stops import cut_at_stop_string, first_stop_token, stop_token_ids
from dominospec.models.domino import DFlashDraftModel, DraftContextCache
from dominospec.target import Target

MODES = ("ar", "dflash", "domino")


@dataclass
class GenerationStats:
    """What one generation cost and how well the draft did."""

    mode: str
    prompt_tokens: int
    num_draft: int  # K: draft tokens proposed per full round (0 in `ar`)
    new_tokens: int = 0
    rounds: int = 0  # target forwards after the prefill: verify rounds (AR steps in `ar`)
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per round, bonus included
    position_accepted: list[int] = field(default_factory=list)  # [K] rounds whose draft k+1 was accepted
    position_proposed: list[int] = field(default_factory=list)  # [K] rounds that proposed draft k+1
    prefill_s: float = 0.0
    draft_s: float = 0.0  # backbone forwards, base logits, draft-context appends
    rollout_s: float = 0.0  # head rollout (or independent draws with the head off)
    verify_s: float = 0.0  # target forwards after the prefill, acceptance, KV crop
    total_s: float = 0.0
    target_kv_length: int = 0  # at the end: prompt + new_tokens - 1
    draft_context_length: int = 0  # at the end: the same, in spec modes

    def __post_init__(self) -> None:
        self.position_accepted = self.position_accepted or [0] * self.num_draft
        self.position_proposed = self.position_proposed or [0] * self.num_draft

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


class SpecEngine:
    """Target (+ draft) -> `generate(prompt ids) -> Generation`, in mode `ar`, `dflash` or `domino`.

    `num_draft` = K, the draft tokens verified per round, 1..B (None: B-1). The draft forward
    always runs the full block it was trained on; a smaller K only shortens the rollout and the
    verify forward (on CPU the verify cost grows with K, so the best K can be below B-1).
    """

    def __init__(self, target: Target, draft: Optional[DFlashDraftModel], mode: str, num_draft: Optional[int] = None):
        if mode not in MODES:
            raise UserError(f"unknown decoding mode {mode!r}: expected one of {list(MODES)}")
        self.mode, self.target, self.model = mode, target, target.model
        self.device = target.device
        self.dtype = target.embed_tokens.weight.dtype
        self.max_positions = int(self.model.config.max_position_embeddings)
        self.stop_ids = stop_token_ids(target.tokenizer, self.model)
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        self.cache_arg = cache_argument(self.model)
        self.draft, self.num_draft, self.block_size = None, 0, 1
        if mode == "ar":
            return
        if draft is None:
            raise UserError(f"mode {mode!r} needs a draft model")
        check_draft_matches(draft.config, target)
        if mode == "domino" and not draft.config.use_domino_head:
            raise UserError("mode 'domino' needs a draft trained with the Domino head (config.use_domino_head is false)")
        weight = draft.fc.weight
        resolved = torch.empty(0, device=self.device).device  # "cuda" -> "cuda:0"
        if weight.dtype != self.dtype or weight.device != resolved:
            raise UserError(f"draft is {weight.dtype} on {weight.device}, target {self.dtype} on {self.device}: cast it")
        self.draft = draft.eval()
        self.block_size = int(draft.config.block_size)
        if self.block_size < 2:
            raise UserError(f"draft block_size must be >= 2, got {self.block_size}")
        self.num_draft = self.block_size - 1 if num_draft is None else num_draft
        if not 1 <= self.num_draft <= self.block_size:
            raise UserError(f"num_draft must lie in 1..block_size ({self.block_size}), got {self.num_draft}")
        self.layer_ids = draft.config.target_layer_ids
        mask = torch.full((self.block_size - 1,), int(draft.config.mask_token_id), device=self.device)
        with torch.inference_mode():
            self.mask_embeds = self.embed_tokens(mask)  # [B-1, H], the block's MASK slots

    # ---- public -----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_strings: Sequence[str] = (),
        seed: Optional[int] = None,
        on_tokens: Optional[Callable[[list[int]], bool]] = None,
    ) -> Generation:
        """Prompt token ids [T] -> Generation of at most `max_new_tokens` tokens (fewer when a stop
        token or stop string ends it, or the target's context is full). `seed` seeds sampling.

        `on_tokens` (streaming) is called after the first token and after every round with the ids
        committed in that step, after stop-token, budget and stop-string trimming: the chunks
        concatenate to `token_ids`. It returning False ends generation with finish_reason "abort"
        (e.g. the client has gone). The text of a chunk may still end in part of a stop string that
        a later step completes; `Generation.text` is the authoritative text.
        """
        prompt = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)  # [T]
        T = prompt.numel()
        if T == 0:
            raise UserError("the prompt is empty")
        if T >= self.max_positions:
            raise UserError(
                f"the prompt has {T} tokens but the target's context holds {self.max_positions} "
                "(max_position_embeddings): no room to generate"
            )
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = min(max_new_tokens, self.max_positions - T)
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        stops = tuple(s for s in stop_strings if s)
        spec = self.mode != "ar"
        stats = GenerationStats(self.mode, T, self.num_draft)

        t_begin = self._now()
        kv = DynamicCache()
        context = DraftContextCache(len(self.draft.layers)) if spec else None
        out = self._target_forward(prompt[None], kv, hidden=spec, keep=1)
        first = int(sampling.sample(out.logits[0, -1:], generator)[0])
        if spec:
            self._append_context(context, out.hidden_states, T)
        stats.prefill_s = self._now() - t_begin

        tokens: list[int] = []
        new, reason = self._admit(tokens, [first], budget)
        tokens += [first][:new]
        checked = 0  # characters of the text already searched for stop strings
        streamed = 0  # tokens already handed to on_tokens
        while True:
            if stops:
                text = self._decode(tokens)
                if cut_at_stop_string(text, stops, max(0, checked - max(map(len, stops)))) is not None:
                    tokens = self._trim_to_stop_string(tokens, len(tokens) - new, stops)
                    reason = "stop_string"
                checked = len(text)
            if on_tokens is not None:
                keep_going = on_tokens(tokens[streamed:])  # this step's committed ids, never empty
                streamed = len(tokens)
                if not keep_going and reason is None:
                    reason = "abort"
            if reason is not None:
                break
            start = T + len(tokens) - 1  # position of x_start = tokens[-1]
            if spec:
                assert kv_length(kv) == start and context.length == start, "KV caches out of step"
                new, reason = self._spec_round(kv, context, tokens, start, budget, sampling, generator, stats)
            else:
                new, reason = self._ar_step(kv, tokens, budget, sampling, generator, stats)

        # Invariant after generation: both caches hold the committed prefix minus the last token.
        crop_kv(kv, T + len(tokens) - 1)
        if spec:
            context.crop(T + len(tokens) - 1)
        stats.new_tokens = len(tokens)
        stats.total_s = self._now() - t_begin
        stats.target_kv_length = kv_length(kv)
        stats.draft_context_length = context.length if spec else 0
        text = self._decode(tokens)
        if reason == "stop_string":
            text = text[: cut_at_stop_string(text, stops)]
        return Generation(token_ids=tokens, text=text, finish_reason=reason, stats=stats)

    # ---- one round --------------------------------------------------------------------------

    def _spec_round(self, kv, context, tokens, start, budget, sampling, generator, stats) -> tuple[int, Optional[str]]:
        """Draft, verify, accept, crop, extend the draft context -> (tokens committed, finish reason)."""
        K = min(self.num_draft, budget - len(tokens) - 1)  # >= 0; the bonus fills the last slot
        x_start = torch.tensor([tokens[-1]], device=self.device)
        t0 = self._now()
        draft_tokens, draft_probs = x_start[:0], None  # K = 0: a plain target step
        if K > 0:
            block = torch.cat([self.embed_tokens(x_start), self.mask_embeds])[None]  # [1, B, H]
            positions = torch.arange(start, start + self.block_size, device=self.device)[None]
            z = self.draft(block, positions, cache=context)[0, :K]  # [K, H]; slot j predicts x[start+1+j]
            base_logits = self.lm_head(z)  # [K, V]
            t1 = self._now()
            draft_tokens, draft_probs = self._rollout(z, base_logits, x_start, sampling, generator)
        else:
            t1 = t0
        t2 = self._now()

        verify_ids = torch.cat([x_start, draft_tokens])[None]  # [1, K+1]
        out = self._target_forward(verify_ids, kv, hidden=True, keep=K + 1)
        logits = out.logits[0]  # [K+1, V]; row i: the target's next-token logits after verify_ids[i]
        if sampling.greedy:
            n, nxt = accept_greedy(draft_tokens, logits)
        else:
            n, nxt = accept_sampled(draft_tokens, draft_probs, sampling.probs(logits), generator)
        proposed = draft_tokens[:n].tolist() + [nxt]
        m, reason = self._admit(tokens, proposed, budget)
        tokens += proposed[:m]
        crop_kv(kv, start + m)  # keep x_start, d_1..d_{m-1}
        t3 = self._now()
        self._append_context(context, out.hidden_states, m)  # the same m rows -> draft context
        t4 = self._now()

        stats.rounds += 1
        stats.accepted_lengths.append(m)
        for k in range(K):
            stats.position_proposed[k] += 1
        for k in range(n):
            stats.position_accepted[k] += 1
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.rollout_s += t2 - t1
        stats.verify_s += t3 - t2
        return m, reason

    def _rollout(self, z, base_logits, x_start, sampling, generator) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """z [K, H], u [K, V] -> draft tokens [K] and, when sampling, the warped q [K, V] they were drawn from."""
        if self.mode == "dflash":  # head off: independent draws from u
            if sampling.greedy:
                return base_logits.argmax(-1), None
            q = sampling.probs(base_logits)
            return torch.multinomial(q, 1, generator=generator)[:, 0], q
        if sampling.greedy:
            rollout = self.draft.rollout(z, base_logits, x_start, self.embed_tokens, num_draft=z.shape[0])
            return rollout.tokens, None
        q_rows: list[torch.Tensor] = []

        def draw(logits: torch.Tensor) -> torch.Tensor:  # [1, V] head-corrected -> [1]
            q_rows.append(sampling.probs(logits))
            return torch.multinomial(q_rows[-1], 1, generator=generator)[:, 0]

        rollout = self.draft.rollout(z, base_logits, x_start, self.embed_tokens, sampler=draw, num_draft=z.shape[0])
        return rollout.tokens, torch.cat(q_rows)

    def _ar_step(self, kv, tokens, budget, sampling, generator, stats) -> tuple[int, Optional[str]]:
        """One target forward on the last token -> (1, finish reason)."""
        t0 = self._now()
        x = torch.tensor([[tokens[-1]]], device=self.device)
        out = self._target_forward(x, kv, hidden=False, keep=1)
        nxt = int(sampling.sample(out.logits[0, -1:], generator)[0])
        m, reason = self._admit(tokens, [nxt], budget)
        tokens += [nxt][:m]
        stats.rounds += 1
        stats.accepted_lengths.append(m)
        stats.verify_s += self._now() - t0
        return m, reason

    # ---- helpers ----------------------------------------------------------------------------

    def _target_forward(self, ids: torch.Tensor, kv: DynamicCache, hidden: bool, keep: int):
        """ids [1, T] after the cached rows (appended to `kv`) -> output with logits [1, keep, V]
        for the last `keep` positions, and all hidden states when `hidden`."""
        return self.model(input_ids=ids, **{self.cache_arg: kv}, use_cache=True, output_hidden_states=hidden,
                          logits_to_keep=keep)

    def _admit(self, tokens: list[int], proposed: list[int], budget: int) -> tuple[int, Optional[str]]:
        """How many of `proposed` may follow `tokens` -> (count, finish reason or None)."""
        room = budget - len(tokens)
        stop = first_stop_token(proposed[:room], self.stop_ids)
        if stop is not None:
            return stop + 1, "stop_token"
        if len(proposed) >= room:
            return room, "length"
        return len(proposed), None

    def _append_context(self, context: DraftContextCache, hidden_states, rows: int) -> None:
        """The first `rows` positions of a target forward's hidden states -> draft context rows."""
        features = torch.cat([hidden_states[l + 1][:, :rows] for l in self.layer_ids], dim=-1)  # [1, rows, n*H]
        self.draft.extend_context(features, context)

    def _trim_to_stop_string(self, tokens: list[int], round_start: int, stops: tuple[str, ...]) -> list[int]:
        """Shortest prefix of `tokens` (at least `round_start + 1` long) whose text holds a stop string."""
        for i in range(max(round_start, 0) + 1, len(tokens) + 1):
            if cut_at_stop_string(self._decode(tokens[:i]), stops) is not None:
                return tokens[:i]
        return tokens

    def _decode(self, tokens: list[int]) -> str:
        return self.target.tokenizer.decode(tokens, skip_special_tokens=True)

    def _now(self) -> float:
        """Wall clock; waits for queued GPU work first so phases are timed, not launched."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
