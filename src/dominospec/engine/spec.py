"""Speculative decoding with a Domino / DFlash draft or prompt lookup, batch size 1, and the AR baseline.

One `SpecEngine` per (target, draft, mode); `generate(prompt ids) -> Generation`:

- `ar`: plain autoregressive decoding, one target forward per token (the baseline).
- `ngram`: prompt-lookup drafting (engine.ngram): no draft model, no draft forward.
- `dflash`: the draft backbone proposes a block, each draft token an independent draw from the
  base logits u (head off).
- `domino`: the same block, drafted by the Domino rollout (GRU-corrected logits u + delta).
- `dominotree`: the same block and head, drafting a best-first tree of `tree_nodes` nodes
  (engine.domino_tree), of which auto-budget verifies the best n (engine.tree_policy).
With `ngram_assist` a draft mode's round whose context offers a prompt-lookup continuation verifies
that instead, or, with `ngram_fork` (greedy), beside the draft; with `tree_width` W > 1 (greedy) the
draft's W best first tokens are verified as W chains (engine.proposers).

The mode picks a proposer once (engine.proposers); every round is the same (engine.round): plan,
draft block, proposal, one verify, one acceptance (engine.accept), commit, learn. The runners
(engine.runners) are chosen once too: dynamic or static caches, transformers' forward or the lean
decoder. Invariant between rounds: target KV length == draft context + pending features ==
prompt + emitted - 1; x_start, the last committed token, has no target KV yet.

`num_draft` = K_max, the draft tokens verified per round, 1..B (None: B-1; in `ngram`
`ngram_num_draft`), or "auto": K in 0..K_max chosen every round (engine.policy) from the round cost
measured on the first prompt (`calibrate`) and the acceptance of the generation's recent rounds.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Optional, Sequence, Union

import torch

from dominospec.config import EngineParams
from dominospec.engine.clock import PhaseClock
from dominospec.engine.configure import head_kernel, static_caches
from dominospec.engine.cost import measure_round_cost
from dominospec.engine.detok import IncrementalDetokenizer
from dominospec.engine.domino_tree import MAX_TREE_NODES, TreeGrower
from dominospec.engine.draft_head import draft_head
from dominospec.engine.loading import check_draft_matches
from dominospec.engine.ngram import NgramIndex
from dominospec.engine.packed import linear_for, pack_linears
from dominospec.engine.policy import RoundCost
from dominospec.engine.proposers import DraftChains, DraftTree, LookupSteps, PlainSteps, Proposer
from dominospec.engine.round import RoundState, play_round
from dominospec.engine.runners import EngineRunners
from dominospec.engine.sampling import Sampling
from dominospec.engine.stats import Generation, GenerationStats
from dominospec.engine.stops import admit, cut_at_stop_string, stop_token_ids
from dominospec.errors import UserError
from dominospec.models.domino import DFlashDraftModel
from dominospec.target import DTYPES, Target

MODES = ("ar", "ngram", "dflash", "domino", "dominotree")
DRAFT_MODES = ("dflash", "domino", "dominotree")
HEAD_MODES = ("domino", "dominotree")  # the modes that run the Domino head


class SpecEngine:
    """Target (+ draft) -> `generate(prompt ids) -> Generation` in one mode (module docstring)."""

    def __init__(self, target: Target, draft: Optional[DFlashDraftModel], mode: str,
                 num_draft: Union[int, str, None] = None, params: Optional[EngineParams] = None):
        if mode not in MODES:
            raise UserError(f"unknown decoding mode {mode!r}: expected one of {list(MODES)}")
        if params is None:
            raise UserError("SpecEngine needs the engine's params (params.yaml `engine:`, config.EngineParams)")
        if params.linear not in ("packed", "torch"):
            raise UserError(f"engine.linear: {params.linear} is resolved by engine.configure.prepare_target(), "
                            "which times the target; pass dataclasses.replace(params, linear=its choice)")
        self.mode, self.target, self.model, self.params = mode, target, target.model, params
        self.packed = params.linear == "packed"  # the draft path's linears pre-packed for oneDNN (engine.packed)
        self.static_cache, self.cuda_graphs = static_caches(params)  # fixed-size caches; CUDA graphs replayed on them
        self.head_kernel = head_kernel(params.head_kernel)  # checked: triton runs here
        self.device = target.device
        self.dtype = target.embed_tokens.weight.dtype
        self.max_positions = int(self.model.config.max_position_embeddings)
        self.stop_ids = frozenset(stop_token_ids(target.tokenizer, self.model))
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head
        self.draft, self.block_size, self.layer_ids, self.mask_embeds = None, 1, [], None
        self.draft_dtype, self.draft_lm_head = self.dtype, None
        self.head, self.grower = None, None  # the draft's proposal (engine.draft_head), DominoTree's build
        self.auto = num_draft == "auto"
        self.tree_width = params.tree_width if mode in ("dflash", "domino") else 1
        self.tree_nodes = params.tree_nodes if mode == "dominotree" else 0
        self._events: list = []  # CUDA events the generations' phase clocks reuse (engine.clock)
        if params.tree_width < 1:
            raise UserError(f"engine.tree_width must be >= 1 (1 = a chain), got {params.tree_width}")
        if mode in DRAFT_MODES:
            self._load_draft(draft, mode, params)
        elif mode == "ngram":
            self.block_size = params.ngram_num_draft + 1
        self.num_draft = self._k_max(num_draft)
        self.lookup_k_max = self.num_draft if mode == "ngram" else (params.ngram_num_draft if params.ngram_assist and
                                                                      self.draft is not None else 0)
        self.proposer = self._proposer(mode)
        self.runners = EngineRunners(self.target, params, max(self.block_size, self.max_verify) + 1, self.device,
                                     self.static_cache, self.cuda_graphs, self.packed, self.draft, self.draft_lm_head,
                                     self.embed_tokens, self.mask_embeds, tuple(self.layer_ids))

    def _load_draft(self, draft: Optional[DFlashDraftModel], mode: str, params: EngineParams) -> None:
        """The draft, checked against the target and the mode, on the draft path (dtype, packing)."""
        if draft is None:
            raise UserError(f"mode {mode!r} needs a draft model")
        check_draft_matches(draft.config, self.target)
        if mode in HEAD_MODES and not draft.config.use_domino_head:
            raise UserError(f"mode {mode!r} needs a draft trained with the Domino head "
                            "(config.use_domino_head is false)")
        resolved = torch.empty(0, device=self.device).device  # "cuda" -> "cuda:0"
        if draft.fc.weight.device != resolved:
            raise UserError(f"draft is on {draft.fc.weight.device}, target on {self.device}: move it")
        self.draft_dtype = DTYPES[params.draft_dtype] if params.draft_dtype else self.dtype
        self.draft, self.draft_lm_head = self._draft_path(draft.eval())
        self.block_size = int(draft.config.block_size)
        if self.block_size < 2:
            raise UserError(f"draft block_size must be >= 2, got {self.block_size}")
        self.head = draft_head(self.draft, self.embed_tokens, mode, self.head_kernel, params.candidate_pool,
                               self.static_cache, self.cuda_graphs, self.block_size, self.draft_dtype, self.device)
        if mode == "dominotree":
            if params.tree_nodes < 1 or params.tree_children < 1:
                raise UserError(f"engine.tree_nodes and engine.tree_children must be >= 1, got "
                                f"{params.tree_nodes} and {params.tree_children}")
            if params.tree_nodes > MAX_TREE_NODES:
                raise UserError(f"engine.tree_nodes is at most {MAX_TREE_NODES} (a verify of 1 + nodes + lookup "
                                f"rows), got {params.tree_nodes}")
            self.grower = TreeGrower(self.draft, self.embed_tokens, params.tree_nodes, params.tree_children,
                                     params.candidate_pool, self.block_size, self.draft_lm_head.weight.shape[0],
                                     self.draft_dtype, self.device, graphs=self.cuda_graphs)
        self.layer_ids = list(draft.config.target_layer_ids)
        mask = torch.full((self.block_size - 1,), int(draft.config.mask_token_id), device=self.device)
        with torch.inference_mode():
            self.mask_embeds = self.embed_tokens(mask).to(self.draft_dtype)  # [B-1, H], the block's MASK slots

    def _k_max(self, num_draft: Union[int, str, None]) -> int:
        """K_max: `num_draft`, or B - 1 (ngram: ngram_num_draft) when None or auto; 0 in `ar`."""
        if self.mode == "ar":
            return 0
        limit = self.block_size
        if num_draft is not None and not self.auto and not (isinstance(num_draft, int) and 1 <= num_draft <= limit):
            raise UserError(f"num_draft must be 'auto' or lie in 1..{limit}, got {num_draft!r}")
        return limit - 1 if num_draft is None or self.auto else num_draft

    def _proposer(self, mode: str) -> Proposer:
        """The mode's proposer (engine.proposers), with the engine's K_max, lookups and auto-K."""
        shared = dict(num_draft=self.num_draft, lookup_k_max=self.lookup_k_max, window=self.params.acceptance_window,
                      auto=self.auto, fork=self.params.ngram_fork and self.lookup_k_max > 0 and mode != "ngram",
                      device=self.device)
        if mode == "dominotree":
            return DraftTree(self.grower, self.tree_nodes, **shared)
        if mode in ("dflash", "domino"):
            return DraftChains(self.head, self.tree_width, self.params.confidence_cut, **shared)
        return (LookupSteps if mode == "ngram" else PlainSteps)(**shared)

    @property
    def max_verify(self) -> int:
        """The most tokens one round verifies (W chains of K, a tree's nodes, a lookup, or both, forking)."""
        return self.proposer.max_rows

    @property
    def cost(self) -> Optional[RoundCost]:
        """Auto-K's measured round cost (`calibrate`), None before."""
        return self.proposer.cost

    @cost.setter
    def cost(self, cost: Optional[RoundCost]) -> None:
        self.proposer.cost = cost

    def _draft_path(self, draft: DFlashDraftModel):
        """The draft (and the LM head giving its base logits) in the draft path's dtype, packed when asked.
        A copy when anything changes: the caller's draft is shared by other engines."""
        if self.draft_dtype == draft.fc.weight.dtype and not self.packed:
            return draft, self.lm_head
        draft = copy.deepcopy(draft).to(self.draft_dtype)
        if self.device.type == "cpu" and self.head_kernel != "triton":
            draft.prefix_gru.float()  # the GRU cell in fp32 on CPU: faster than torch's bf16 mm there, as exact
        if self.packed:
            pack_linears(draft)
        return draft, linear_for(self.lm_head, self.draft_dtype, self.packed)

    @torch.inference_mode()
    def generate(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_strings: Sequence[str] = (), seed: Optional[int] = None,
                 on_tokens: Optional[Callable[[list[int]], bool]] = None) -> Generation:
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
        if self.auto and self.cost is None:
            self.calibrate(prompt.tolist())
        self.proposer.fresh()  # auto-K learns afresh: K depends on this generation's rounds alone
        budget = min(max_new_tokens, self.max_positions - T)
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        stops = tuple(s for s in stop_strings if s)
        stats = GenerationStats(self.mode, T, self.num_draft)
        drafting = self.draft is not None

        t_begin = self.now()
        rows = T + budget + self.runners.max_rows
        state = RoundState(*self.runners.pair(rows), PhaseClock(self.device, self._events), self.device)
        stats.static_cache = self.runners.fits_static(rows)
        logits, features = state.kv.forward(prompt[None], keep=1)
        first = int(sampling.sample(logits[0, -1:], generator)[0])
        if drafting:
            state.pending.append(features)
        stats.prefill_s = self.now() - t_begin
        if self.mode == "ngram" or (drafting and self.params.ngram_assist):
            state.index = NgramIndex(self.params.ngram_min, self.params.ngram_max)
            state.index.extend(prompt.tolist())

        tokens: list[int] = []
        new, reason = admit(tokens, [first], budget, self.stop_ids)
        tokens += [first][:new]
        detok = IncrementalDetokenizer(self._decode) if stops else None
        streamed = 0  # tokens already handed to on_tokens
        while True:
            if state.index is not None:
                state.index.extend(tokens[len(state.index.tokens) - T:])
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
            new, reason = play_round(self.proposer, state, tokens, start, budget, sampling, generator, stats,
                                     self.stop_ids)

        # Invariant after generation: both caches hold the committed prefix minus the last token.
        state.kv.crop(T + len(tokens) - 1)
        if drafting:
            state.flush()
            state.drafter.crop(T + len(tokens) - 1)
        stats.new_tokens = len(tokens)
        stats.total_s = self.now() - t_begin
        phases = state.clock.seconds()
        stats.draft_s, stats.rollout_s = phases.get("draft", 0.0), phases.get("rollout", 0.0)
        stats.verify_s, stats.draft_round_s = phases.get("verify", 0.0), phases.get("draft_round", 0.0)
        stats.target_kv_length = state.kv.length
        stats.draft_context_length = state.drafter.length if drafting else 0
        text = self._decode(tokens)
        if reason == "stop_string":
            text = text[: cut_at_stop_string(text, stops)]
        return Generation(token_ids=tokens, text=text, finish_reason=reason, stats=stats)

    @torch.inference_mode()
    def capture(self, rows: int) -> None:
        """Run every shape a generation of at most `rows` positions can replay once, on its static
        runners: the verify of each T rows, the draft block of each S appended rows, the greedy
        rollout of each K (and W). Their CUDA graphs are then captured (and the kernels compiled)
        before the first request, not inside a timed one. A no-op on the dynamic caches."""
        if not self.runners.fits_static(rows):
            return
        kv, drafter = self.runners.pair(rows)
        ids = torch.zeros(1, kv.max_rows, dtype=torch.long, device=self.device)  # any ids: only the shapes matter
        _, features = kv.forward(ids[:, :2], keep=1)
        for T in kv.buckets:
            kv.forward(ids[:, :T], keep=T)
            kv.crop(2)
        if drafter is None:
            return
        drafter.extend(features[:, :1])
        x_start = ids[0, :1]
        for S in range(self.block_size + 1):
            z, base_logits = drafter.block(features[:, :1].expand(1, S, -1) if S else None, x_start, 1 + S,
                                           self.block_size)
            drafter.crop(1)
        for K in range(1, self.num_draft + 1):
            self.head.chain(z[:K], base_logits[:K], x_start, Sampling(), None, self.params.confidence_cut > 0)
            for W in range(2, self.tree_width + 1):
                self.head.branches(z[:K], base_logits[:K], x_start, W)
            if self.grower is not None:
                self.grower.grow(z[:K], base_logits[:K], x_start)

    def capture_all(self) -> None:
        """On CUDA graphs: `capture` every capacity bucket, so that no request waits for a capture
        (a server's start-up). A no-op without graphs."""
        if self.runners.static and self.runners.graphs:
            for capacity in self.runners.capacities():
                self.capture(capacity)

    def calibrate(self, prompt: list[int], shared: Optional[RoundCost] = None) -> RoundCost:
        """Measure this machine's round cost by K on `prompt` (engine.cost) -> the cost auto-K uses.
        `shared`: another engine's cost on the same target and draft, whose verify and draft
        forward costs this engine takes (engine.cost.measure_round_cost)."""
        kv, drafter = self.runners.pair(len(prompt) + self.runners.max_rows)
        ids = torch.tensor(prompt, device=self.device)
        self.cost = measure_round_cost(kv, drafter, self.head, self.grower, self.tree_width, ids, self.num_draft,
                                       self.max_verify + 1, self.draft_dtype, self.now, shared=shared)
        return self.cost

    def graph_failures(self) -> dict[str, str]:
        """Shapes whose CUDA-graph capture failed (they run eagerly) -> the error, by runner, capacity and shape."""
        failures = self.runners.failures()
        if self.head is not None and self.head.graphs is not None:
            failures.update({f"head rollout {key}": err for key, err in self.head.graphs.graphs.failures.items()})
        if self.grower is not None:
            failures.update({f"tree build {key}": err for key, err in self.grower.graphs.failures.items()})
        return failures

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
