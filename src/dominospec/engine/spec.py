"""Speculative decoding at batch size 1: `SpecEngine(target, draft, mode, num_draft, params)`, one per
(target, draft, mode); `generate(prompt ids) -> Generation` (docs/design.md §1.5). The resolve step
(engine.decoding) makes the frozen `Decoding`; from it the draft path, the proposers (a `domino` engine
keeps a second for sampled requests) and the runners; every round is engine.round's. Between rounds:
target KV length == draft context + pending features == prompt + emitted - 1 (x_start, the last
committed token, has no KV yet). `num_draft`: K_max (None: B - 1; ngram: ngram_num_draft) or "auto",
K in 0..K_max chosen every round (engine.policy) from the cost measured on the first prompt (`calibrate`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

import torch

from dominospec.config import EngineParams
from dominospec.engine.cost import measure_round_cost
from dominospec.engine.decoding import MODES, resolve
from dominospec.engine.draft_path import DraftPath, load_draft_path
from dominospec.engine.policy import RoundCost
from dominospec.engine.proposers import proposer_for
from dominospec.engine.round import Request, RoundState, admit, play_round
from dominospec.engine.runners import EngineRunners
from dominospec.engine.sampling import Sampling
from dominospec.engine.stats import Generation, GenerationStats
from dominospec.stops import IncrementalDetokenizer, cut_at_stop_string, stop_token_ids
from dominospec.errors import UserError
from dominospec.models.domino import DFlashDraftModel
from dominospec.target import Target

class SpecEngine:
    """Target (+ draft) -> `generate(prompt ids) -> Generation` in one mode (module docstring)."""

    def __init__(self, target: Target, draft: Optional[DFlashDraftModel], mode: str,
                 num_draft: Union[int, str, None] = None, params: Optional[EngineParams] = None):
        self.decoding = d = resolve(target, draft, mode, num_draft, params)  # nothing below reads mode or params
        self.mode, self.target, self.model = d.name, target, target.model
        self.params = params  # a record for its callers; the engine reads `decoding`
        self.device = target.device
        self.max_positions = int(self.model.config.max_position_embeddings)
        self.stop_ids = frozenset(stop_token_ids(target.tokenizer, self.model))
        self.path: Optional[DraftPath] = load_draft_path(draft, target, d) if d.drafting else None
        self.draft, self.head, self.grower = (self.path.model, self.path.head, self.path.grower) if self.path else (None,) * 3
        self.block_size, self.num_draft, self.nodes, self.auto = d.block_size, d.k_max, d.nodes, d.auto
        self.lookup_k_max = d.lookup.k_max
        self._events: list = []  # CUDA events the generations' phase clocks reuse (engine.clock)
        self.proposer = proposer_for(d, self.head, self.grower, self.device)  # greedy requests'
        self.sampled_proposer = (proposer_for(d, self.head, self.grower, self.device, sampled=True)
                                 if d.sampled_chain else self.proposer)
        self.runners = EngineRunners(target, d, self.path)

    @property
    def max_verify(self) -> int:
        """The most tokens one round verifies (engine.decoding)."""
        return self.decoding.max_verify

    @property
    def cost(self) -> Optional[RoundCost]:
        """Auto-K's measured round cost (`calibrate`), None before."""
        return self.proposer.cost

    @cost.setter
    def cost(self, cost: Optional[RoundCost]) -> None:
        self.proposer.cost = self.sampled_proposer.cost = cost

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_strings: Sequence[str] = (), seed: Optional[int] = None,
                 on_tokens: Optional[Callable[[list[int]], bool]] = None) -> Generation:
        """Prompt token ids [T] -> Generation of at most `max_new_tokens` tokens (fewer at a stop token or
        string, or a full context). `seed` seeds sampling. `on_tokens` (streaming) gets the ids each step
        committed (after stop and budget trimming: the chunks concatenate to `token_ids`); False from it
        ends generation ("abort"). A chunk's text may end in part of a stop string; `Generation.text` is
        the authoritative text."""
        prompt = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)  # [T]
        T = prompt.numel()
        if T == 0:
            raise UserError("the prompt is empty")
        if T >= self.max_positions:
            raise UserError(f"the prompt has {T} tokens but the target's context holds {self.max_positions} "
                            "(max_position_embeddings): no room to generate")
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.auto and self.cost is None:
            self.calibrate(prompt.tolist())
        proposer = self.proposer if sampling.greedy else self.sampled_proposer
        proposer.fresh()  # auto-K learns afresh: K depends on this generation's rounds alone
        budget = min(max_new_tokens, self.max_positions - T)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed) if seed is not None else generator.seed()
        stops = tuple(s for s in stop_strings if s)
        request = Request(budget, sampling, generator, self.stop_ids)
        stats = GenerationStats(self.mode, T, self.num_draft)
        drafting = self.draft is not None

        t_begin = self.now()
        rows = T + budget + self.runners.max_rows
        state = RoundState(*self.runners.pair(rows), self.device, self._events)
        stats.static_cache = self.runners.fits_static(rows)
        logits, features = state.kv.forward(prompt[None], keep=1)
        first = int(sampling.sample(logits[0, -1:], generator)[0])
        if drafting:
            state.pending.append(features)
        stats.prefill_s = self.now() - t_begin
        if self.decoding.lookup.k_max:
            state.look_up(prompt.tolist(), self.decoding.lookup.ngram_min, self.decoding.lookup.ngram_max)

        tokens: list[int] = []
        new, reason = admit(tokens, [first], budget, self.stop_ids)
        tokens += [first][:new]
        detok = IncrementalDetokenizer(self._decode) if stops else None
        streamed = 0  # tokens already handed to on_tokens
        while True:
            state.catch_up(tokens)
            if detok is not None:
                clean, checked = detok.read_offset, len(detok.text)  # tokens[:clean] hold no stop string
                detok.push(tokens[len(detok.tokens):])
                if cut_at_stop_string(detok.text, stops, max(0, checked - max(map(len, stops)))) is not None:
                    tokens = self._trim_to_stop_string(tokens, min(clean, len(tokens) - new), stops)
                    reason = "stop_string"
            if on_tokens is not None:
                keep_going = on_tokens(tokens[streamed:])  # this step's committed ids, never empty
                streamed = len(tokens)
                if not keep_going and reason is None:
                    reason = "abort"
            if reason is not None:
                break
            start = T + len(tokens) - 1  # position of x_start = tokens[-1]
            assert state.kv.length == start, "target KV out of step"
            new, reason = play_round(proposer, state, tokens, start, request, stats)

        # Invariant after generation: both caches hold the committed prefix minus the last token.
        state.kv.crop(T + len(tokens) - 1)
        if drafting:
            state.flush()
            state.drafter.crop(T + len(tokens) - 1)
        stats.new_tokens = len(tokens)
        stats.total_s = self.now() - t_begin
        phases = state.clock.seconds()
        stats.draft_s, stats.rollout_s, stats.verify_s, stats.draft_round_s = (
            phases.get(p, 0.0) for p in ("draft", "rollout", "verify", "draft_round"))
        stats.target_kv_length = state.kv.length
        stats.draft_context_length = state.drafter.length if drafting else 0
        text = self._decode(tokens)
        if reason == "stop_string":
            text = text[: cut_at_stop_string(text, stops)]
        return Generation(token_ids=tokens, text=text, finish_reason=reason, stats=stats)

    def capture(self, rows: int) -> None:
        """Capture the CUDA graphs a generation of at most `rows` positions replays (engine.runners)."""
        self.runners.capture(rows, self.num_draft)

    def capture_all(self) -> None:
        """`capture` every capacity bucket (a server's start-up); a no-op without graphs."""
        self.runners.capture_all(self.num_draft)

    def calibrate(self, prompt: list[int], shared: Optional[RoundCost] = None) -> RoundCost:
        """This machine's round cost measured on `prompt` (engine.cost; `shared`: another engine's on the
        same target and draft, whose verify and draft forward costs it takes) -> the cost auto-K uses."""
        kv, drafter = self.runners.pair(len(prompt) + self.runners.max_rows)
        ids = torch.tensor(prompt, device=self.device)
        self.cost = measure_round_cost(kv, drafter, self.path, self.decoding, ids, self.now, shared=shared)
        return self.cost

    def graph_failures(self) -> dict[str, str]:
        """Shapes whose CUDA-graph capture failed (they run eagerly) -> the error, by runner, capacity and shape."""
        return self.runners.graph_failures()

    def _trim_to_stop_string(self, tokens: list[int], clean: int, stops: tuple[str, ...]) -> list[int]:
        """Shortest prefix of `tokens` (longer than `clean`, whose text holds no stop string) whose text holds one."""
        for i in range(max(clean, 0) + 1, len(tokens) + 1):
            if cut_at_stop_string(self._decode(tokens[:i]), stops) is not None:
                return tokens[:i]
        return tokens

    def _decode(self, tokens: list[int]) -> str:
        return self.target.tokenizer.decode(tokens, skip_special_tokens=True)

    def now(self) -> float:
        """Wall clock; waits for queued GPU work first so phases are timed, not launched."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
