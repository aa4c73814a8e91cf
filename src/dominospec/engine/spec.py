"""Speculative decoding with a Domino / DFlash draft or prompt lookup, batch size 1, and the AR baseline.

One `SpecEngine` per (target, draft, mode):

- `ar`: plain autoregressive decoding, one target forward per token (the baseline).
- `ngram`: prompt-lookup drafting (engine.ngram): no draft model, no draft forward.
- `dflash`: the draft backbone proposes a block, each draft token an independent draw from the
  base logits u (head off).
- `domino`: the same block, drafted by the Domino rollout (GRU-corrected logits u + delta).
- `dominotree`: the same block and head, drafting a best-first tree of `tree_nodes` nodes
  (engine.domino_tree): each path's children scored by that path's own GRU state, the tree
  verified in one forward (ancestors-only attention), greedy or sampled (engine.tree_accept);
  auto-K chooses how many of its best nodes a round verifies (engine.tree_policy).
With `ngram_assist`, a draft-mode round whose context offers a prompt-lookup continuation
verifies that instead (no draft forward; its target features wait in `pending` for the next
draft forward), and drafts otherwise: lookups are free, and on copying stretches they beat the draft.
A lookup proposes up to `ngram_num_draft` tokens whatever the block size (as the `ngram` mode
does), and auto-K keeps two acceptance models, one for lookups and one for the draft's chains,
each choosing its own K against its own round cost (a lookup round pays no draft forward).
With `ngram_fork` as well (greedy), a round with a lookup hit drafts anyway and verifies both, the
chain and the lookup, as two branches of one target forward (engine.fork), keeping the branch the
target accepts further. With `tree_width` W > 1 (greedy) a drafted round verifies the draft's W best
first tokens as W branches, each drafted on (engine.draft_head), beside the lookup when there is one:
a tree of branches sharing row 0. Auto-K chooses (W, K_d, K_l) together (`choose_tree`), which may
narrow the tree to a chain or drop either side.

A round (draft modes). `start` is the position of the last committed token x_start, which has no
target KV yet; at the start of every round the target KV holds exactly positions 0..start-1, and
the draft context plus the target features still waiting to be appended to it (`pending`) hold
the same rows (invariant checked).
  0. K, the drafts to verify: fixed (`num_draft`), or chosen by auto-K (engine.policy) from the
     measured acceptance by position and the measured round cost; K = 0 is a plain target step
     (no draft forward). Near the token budget K shrinks to what can still be emitted. With
     ngram_assist a prompt-lookup hit (its own K) replaces steps 1-2; with ngram_fork it is
     verified beside the chain in step 3, as a second branch.
  1. draft forward over `[x_start, MASK x (B-1)]` at positions start..start+B-1, the pending
     features appended first -> z [B, H]; base logits u = lm_head(z[:K]) [K, V], all in the draft
     path's dtype (`engine.draft_dtype`: only verification must be exact).
  2. propose (engine.draft_head: the model's rollout, or its kernels): a chain d_1..d_K (candidate
     pool optional), cut where the draft's own confidence product falls below `confidence_cut`;
     or W branches of K.
  3. verify: one target forward over [x_start, d_1..d_K] (positions start..start+K), with the
     features of the draft's n target layers (several proposals: a tree, engine.fork) -> a
     Verdict (engine.verdict); acceptance (greedy match, or lossless speculative
     sampling) commits d_1..d_n + one target token.
  4. bookkeeping: with m tokens committed, the target KV is cropped to start+m (keeping x_start,
     d_1..d_{m-1}) and the target features of exactly those m rows become pending; start += m.
So after every round: target KV length == draft context + pending == prompt + emitted - 1.
`ngram` rounds are steps 0, (prompt lookup), 3 and 4 without features.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Optional, Sequence, Union

import torch

from dominospec.config import EngineParams
from dominospec.errors import UserError
from dominospec.engine.detok import IncrementalDetokenizer
from dominospec.engine.draft_block import DynamicDraftBlock, StaticDraftBlock
from dominospec.engine.clock import PhaseClock
from dominospec.engine.configure import head_kernel, static_caches
from dominospec.engine.cost import measure_round_cost
from dominospec.engine.draft_head import DraftChain, DraftHead, draft_head
from dominospec.engine.domino_tree import MAX_TREE_NODES, TreeGrower
from dominospec.engine.fork import MAX_TREE_ROWS, accept_branches, branch_tree
from dominospec.engine.lean_decoder import LeanDecoder, lean_decoder, unsupported
from dominospec.engine.lean_draft import LeanDraft, LeanDraftBlock, lean_draft
from dominospec.engine.lean_kv import LeanTargetKV
from dominospec.engine.loading import check_draft_matches
from dominospec.engine.ngram import NgramIndex
from dominospec.engine.packed import linear_for, pack_linears
from dominospec.engine.policy import AcceptanceModel, RankModel, RoundCost, choose_k, choose_tree
from dominospec.engine.sampling import Sampling, accept_greedy, accept_sampled
from dominospec.engine.stats import Generation, GenerationStats
from dominospec.engine.stops import cut_at_stop_string, first_stop_token, stop_token_ids
from dominospec.engine.tree_policy import TreeModel
from dominospec.engine.tree_round import tree_round
from dominospec.engine.verdict import Verdict
from dominospec.engine.target_kv import DynamicTargetKV, StaticTargetKV
from dominospec.models.domino import DFlashDraftModel
from dominospec.target import DTYPES, Target

MODES = ("ar", "ngram", "dflash", "domino", "dominotree")
MIN_BUCKET = 256  # the smallest static-cache capacity (rows); see static_buckets
DRAFT_MODES = ("dflash", "domino", "dominotree")
HEAD_MODES = ("domino", "dominotree")  # the modes that run the Domino head


class SpecEngine:
    """Target (+ draft) -> `generate(prompt ids) -> Generation`, in mode `ar`, `ngram`, `dflash` or `domino`.

    `num_draft` = K, the draft tokens verified per round, 1..B (None: B-1; in `ngram`
    `ngram_num_draft`), or "auto": K in 0..B-1 chosen every round by the policy (engine.policy),
    from the round cost measured on the first prompt (`calibrate`) and the acceptance of the
    generation's recent rounds.
    """

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
        self.draft, self.num_draft, self.block_size, self.layer_ids = None, 0, 1, []
        self.head: Optional[DraftHead] = None  # how a block's drafts are proposed (engine.draft_head)
        self.auto = num_draft == "auto"
        self.cost: Optional[RoundCost] = None  # auto-K: measured by `calibrate`
        # static runners by capacity bucket: {rows: (StaticTargetKV, StaticDraftBlock or None)}, built on first use
        self._statics: dict[int, tuple] = {}
        self._static: Optional[tuple] = None  # the pair the current (or last) generation runs on
        self._events: list = []  # CUDA events the generations' phase clocks reuse (engine.clock)
        self.lookup_k_max = 0  # the most tokens a prompt lookup proposes (0: no lookups)
        self.tree_width = 1  # the most draft branches a greedy round verifies
        self.tree_nodes = 0  # dominotree: the most tree nodes a round verifies
        self.grower: Optional[TreeGrower] = None  # dominotree: the tree's build (engine.domino_tree)
        if params.tree_width < 1:
            raise UserError(f"engine.tree_width must be >= 1 (1 = a chain), got {params.tree_width}")
        self.lean: Optional[LeanDecoder] = None  # the target on the lean decoder (static caches only)
        self.lean_draft: Optional[LeanDraft] = None  # and the draft's backbone, with it
        self._fresh_acceptance()
        if mode == "ar":
            self._use_lean()
            return
        if mode == "ngram":
            self.block_size = params.ngram_num_draft + 1
            self._set_num_draft(num_draft, params.ngram_num_draft)
            self.lookup_k_max = self.num_draft  # its drafts are the lookups
            self._fresh_acceptance()
            self._use_lean()
            return
        if draft is None:
            raise UserError(f"mode {mode!r} needs a draft model")
        check_draft_matches(draft.config, target)
        if mode in HEAD_MODES and not draft.config.use_domino_head:
            raise UserError(f"mode {mode!r} needs a draft trained with the Domino head (config.use_domino_head is false)")
        resolved = torch.empty(0, device=self.device).device  # "cuda" -> "cuda:0"
        if draft.fc.weight.device != resolved:
            raise UserError(f"draft is on {draft.fc.weight.device}, target on {self.device}: move it")
        self.draft_dtype = DTYPES[params.draft_dtype] if params.draft_dtype else self.dtype
        self.draft, self.draft_lm_head = self._draft_path(draft.eval())
        self.block_size = int(draft.config.block_size)
        self.head = draft_head(self.draft, self.embed_tokens, mode, self.head_kernel, params.candidate_pool,
                               self.static_cache, self.cuda_graphs, self.block_size, self.draft_dtype, self.device)
        if self.block_size < 2:
            raise UserError(f"draft block_size must be >= 2, got {self.block_size}")
        self._set_num_draft(num_draft, self.block_size - 1)
        self.lookup_k_max = params.ngram_num_draft if params.ngram_assist else 0
        if mode == "dominotree":
            if params.tree_nodes < 1 or params.tree_children < 1:
                raise UserError(f"engine.tree_nodes and engine.tree_children must be >= 1, got "
                                f"{params.tree_nodes} and {params.tree_children}")
            if params.tree_nodes > MAX_TREE_NODES:
                raise UserError(f"engine.tree_nodes is at most {MAX_TREE_NODES} (a verify of 1 + nodes + lookup "
                                f"rows), got {params.tree_nodes}")
            self.tree_nodes = params.tree_nodes
            self.grower = TreeGrower(self.draft, self.embed_tokens, params.tree_nodes, params.tree_children,
                                     params.candidate_pool, self.block_size, self.draft_lm_head.weight.shape[0],
                                     self.draft_dtype, self.device, graphs=self.cuda_graphs)
        else:
            self.tree_width = params.tree_width
        self._fresh_acceptance()
        self.layer_ids = list(draft.config.target_layer_ids)
        mask = torch.full((self.block_size - 1,), int(draft.config.mask_token_id), device=self.device)
        with torch.inference_mode():
            self.mask_embeds = self.embed_tokens(mask).to(self.draft_dtype)  # [B-1, H], the block's MASK slots
        self._use_lean()

    def _use_lean(self) -> None:
        """`lean_target` with static caches: the target's forwards on the lean decoder (Triton ops on
        CUDA, their torch references elsewhere). "on" insists (an error names what does not fit);
        "auto" takes it on CUDA where the model is supported and the widest round fits a bitmask."""
        choice = self.params.lean_target
        if choice not in ("on", "off", "auto"):
            raise UserError(f"engine.lean_target must be on, off or auto, got {choice!r}")
        if choice == "off" or not self.static_cache:
            return
        rows = max(self.block_size, self.max_verify) + 1
        problem = (unsupported(self.model) or (rows > MAX_TREE_ROWS and
                                               f"its widest round verifies {rows} rows, over {MAX_TREE_ROWS}")
                   or (self.packed and "the draft path's linears are packed for oneDNN (engine.linear)"))
        if choice == "auto" and (problem or self.device.type != "cuda"):
            return
        if problem:
            raise UserError(f"engine.lean_target: on, but this engine cannot use it: {problem} "
                            "(lower engine.tree_width / ngram_num_draft, or set lean_target: auto)")
        triton = self.device.type == "cuda"
        self.lean = lean_decoder(self.model, triton)
        if self.draft is not None:
            self.lean_draft = lean_draft(self.draft, triton)

    def _set_num_draft(self, num_draft: Union[int, str, None], default: int) -> None:
        limit = self.block_size
        if num_draft is not None and not self.auto and not (isinstance(num_draft, int) and 1 <= num_draft <= limit):
            raise UserError(f"num_draft must be 'auto' or lie in 1..{limit}, got {num_draft!r}")
        self.num_draft = default if num_draft is None or self.auto else num_draft  # K_max

    def _fresh_acceptance(self) -> None:
        """Auto-K's acceptance models, empty: the draft's chains, and prompt lookups (the same
        model in `ngram` mode, where lookups are the drafts; None without lookups)."""
        self.acceptance = AcceptanceModel(self.num_draft, self.params.acceptance_window)
        self.ranks = RankModel(self.tree_width, self.params.acceptance_window)  # the draft's 2nd..W-th guesses
        self.tree_model = TreeModel(self.tree_nodes, self.num_draft, self.params.acceptance_window)  # dominotree
        self.lookup_acceptance: Optional[AcceptanceModel] = None
        if self.mode == "ngram":
            self.lookup_acceptance = self.acceptance
        elif self.lookup_k_max:
            self.lookup_acceptance = AcceptanceModel(self.lookup_k_max, self.params.acceptance_window)

    @property
    def forking(self) -> bool:
        """Draft modes with ngram_assist and ngram_fork: a lookup hit may be verified beside the chain."""
        return self.draft is not None and self.lookup_k_max > 0 and self.params.ngram_fork

    @property
    def max_verify(self) -> int:
        """The most drafts one round can verify: W branches of K <= B (a chain: W = 1), or a prompt
        lookup (both, forking)."""
        drafts = self.tree_nodes or self.num_draft * self.tree_width
        if self.forking:
            return drafts + self.lookup_k_max
        return max(drafts, self.lookup_k_max)

    def _draft_path(self, draft: DFlashDraftModel):
        """The draft (and the LM head giving its base logits) in the draft path's dtype, packed when asked.
        A copy when anything changes: the caller's draft is shared by other engines."""
        if self.draft_dtype == draft.fc.weight.dtype and not self.packed:
            return draft, self.lm_head
        draft = copy.deepcopy(draft).to(self.draft_dtype)
        if self.device.type == "cpu" and self.head_kernel != "triton":
            draft.prefix_gru.float()  # the GRU cell in fp32 on CPU: 3x a bf16 cell's speed there (torch's bf16 mm), as exact
        if self.packed:
            pack_linears(draft)
        return draft, linear_for(self.lm_head, self.draft_dtype, self.packed)

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
        if self.auto and self.cost is None:
            self.calibrate(prompt.tolist())
        # Auto-K learns acceptance afresh in every generation: K then depends only on this
        # generation's rounds (and the fixed cost table), so a seed reproduces a sampled answer.
        self._fresh_acceptance()
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
        state = _State(*self.runners(T + budget + max(self.block_size, self.max_verify) + 1),
                       PhaseClock(self.device, self._events))
        stats.static_cache = isinstance(state.kv, (StaticTargetKV, LeanTargetKV))
        logits, features = state.kv.forward(prompt[None], keep=1)
        first = int(sampling.sample(logits[0, -1:], generator)[0])
        if drafting:
            state.pending.append(features)
        stats.prefill_s = self.now() - t_begin
        if self.mode == "ngram" or (drafting and self.params.ngram_assist):
            state.index = NgramIndex(self.params.ngram_min, self.params.ngram_max)
            state.index.extend(prompt.tolist())

        tokens: list[int] = []
        new, reason = self._admit(tokens, [first], budget)
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
            new, reason = self._round(state, tokens, start, budget, sampling, generator, stats)

        # Invariant after generation: both caches hold the committed prefix minus the last token.
        state.kv.crop(T + len(tokens) - 1)
        if drafting:
            self._flush(state)
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
        if not self.static_cache or rows > self.params.graph_capacity:
            return
        kv, drafter = self.runners(rows)
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
        if self.static_cache and self.cuda_graphs:
            for capacity in static_buckets(self.params.graph_capacity, MIN_BUCKET):
                self.capture(capacity)

    def calibrate(self, prompt: list[int], shared: Optional[RoundCost] = None) -> RoundCost:
        """Measure this machine's round cost by K on `prompt` (engine.cost) -> the cost auto-K uses.
        `shared`: another engine's cost on the same target and draft, whose verify and draft
        forward costs this engine takes (engine.cost.measure_round_cost)."""
        self.cost = measure_round_cost(self, prompt, shared=shared)
        return self.cost

    # ---- one round --------------------------------------------------------------------------

    def _round(self, state, tokens, start, budget, sampling, generator, stats) -> tuple[int, Optional[str]]:
        """Plan, draft, propose, verify, commit (module docstring) -> (tokens committed, finish reason)."""
        if self.mode == "dominotree":
            return tree_round(self, state, tokens, start, budget, sampling, generator, stats)
        x_start = torch.tensor([tokens[-1]], device=self.device)
        with state.clock.round(stats) as timer:
            W, K, lookup = self._plan(state, budget - len(tokens) - 1, sampling.greedy)
            timer.begin(device=K > 0)  # drafting rounds queue work the host does not wait for: timed by CUDA events
            lookup_tokens = torch.tensor(lookup, dtype=torch.long, device=self.device) if lookup else None
            with timer.phase("draft"):
                block = self._draft_forward(state, x_start, start, K) if K else None
            with timer.phase("rollout"):
                drafts, chain = self._propose(block, x_start, W, sampling, generator)
            with timer.phase("verify"):
                verdict = self._verify(state, x_start, drafts, chain, lookup_tokens, sampling, generator, timer)
                m, reason = self._commit(state, tokens, verdict.tokens, verdict.rows, verdict.features, start, budget)
            timer.drafted = verdict.drafted + verdict.lookup > 0
        self._account(stats, verdict, m)
        return m, reason

    def _propose(self, block, x_start, W: int, sampling, generator) -> tuple[list[torch.Tensor], Optional[DraftChain]]:
        """The draft block (z [K, H], u [K, V]) or None -> (the draft's proposals: W branches [K] each
        (greedy), one chain cut at `confidence_cut`, or none; the chain, for its q when sampling)."""
        if block is None:
            return [], None
        z, base_logits = block
        if W > 1:
            return list(self.head.branches(z, base_logits, x_start, W)), None
        chain = self.head.chain(z, base_logits, x_start, sampling, generator, self.params.confidence_cut > 0)
        return [chain.tokens[:self._cut(chain)]], chain

    def _verify(self, state, x_start, drafts: list[torch.Tensor], chain: Optional[DraftChain],
                lookup: Optional[torch.Tensor], sampling, generator, timer) -> Verdict:
        """One target forward over [x_start, proposals] -> Verdict. Several proposals (the draft's
        branches, a lookup beside them: greedy only, see _plan) verify as a tree (engine.fork)."""
        parts = drafts + ([lookup] if lookup is not None else [])
        K, L = (drafts[0].numel() if drafts else 0), (lookup.numel() if lookup is not None else 0)
        ids = torch.cat([x_start, *parts])
        if len(parts) > 1:
            logits, features = state.kv.forward(ids[None], keep=ids.numel(),
                                                tree=branch_tree([p.numel() for p in parts], self.device))
            with timer.waiting():
                tree = accept_branches(parts, logits[0])
            W = len(drafts)
            n_draft = max(tree.per_branch[:W])
            return Verdict(parts[tree.winner][:tree.accepted].tolist() + [tree.next_token], tree.rows, features,
                           drafted=K, branches=W, lookup=L, n_chain=tree.per_branch[0], n_draft=n_draft,
                           n_lookup=tree.per_branch[W] if L else 0, winner=tree.winner,
                           winner_rank=tree.winner + 1 if tree.winner < W and n_draft else 0, branched=True)
        proposal = parts[0] if parts else x_start[:0]
        logits, features = state.kv.forward(ids[None], keep=ids.numel())
        logits = logits[0]  # [K+1, V]; row i: the target's next-token logits after ids[i]
        with timer.waiting():
            if sampling.greedy:
                n, nxt = accept_greedy(proposal, logits)
            else:
                q = self._draft_probs(chain, K, logits.shape[-1]) if K else self._draft_probs(None, L, logits.shape[-1], proposal)
                n, nxt = accept_sampled(proposal, q, sampling.probs(logits), generator)
        return Verdict(proposal[:n].tolist() + [nxt], list(range(n + 1)), features, drafted=K, branches=int(K > 0),
                       lookup=L, n_chain=n, n_draft=n, n_lookup=n, winner_rank=1 if K and n else 0)

    def _account(self, stats, v: Verdict, m: int) -> None:
        """A round's verdict (m tokens committed) -> the generation's stats and auto-K's models. By
        position: the draft's chains, or its best branch (in `ngram` mode its lookups); an assisting
        lookup is not the draft's."""
        if v.branched:
            stats.fork_rounds += v.lookup > 0
            stats.fork_lookup_wins += v.lookup > 0 and v.winner == v.branches
            stats.tree_rounds += v.branches > 1
            stats.tree_side_wins += 0 < v.winner < v.branches
        else:
            stats.lookup_rounds += v.lookup > 0 and self.mode != "ngram"
        if self.mode == "ngram":
            stats.record_round(v.lookup, m, chain=(v.lookup, v.accepted))
        else:
            stats.record_round(v.branches * v.drafted + v.lookup, m, chain=(v.drafted, v.n_draft) if v.drafted else None)
        if self.auto:
            self._learn(v.drafted, v.n_chain, v.lookup, v.n_lookup, v.branches, v.winner_rank)

    def _commit(self, state, tokens: list[int], proposed: list[int], rows: list[int], features, start: int,
                budget: int) -> tuple[int, Optional[str]]:
        """A round's accepted tokens and next token (`proposed`), the verify rows they sit on (row 0
        first) -> tokens committed (stop tokens and the budget admitted), the target KV and the pending
        features keeping exactly those rows; -> (m, finish reason)."""
        m, reason = self._admit(tokens, proposed, budget)
        tokens += proposed[:m]
        state.kv.select(rows[:m])  # a branch other than the first won: its rows into place
        state.kv.crop(start + m)  # keep x_start, then the first m-1 accepted tokens
        if features is not None:
            state.pending.append(features[:, rows[:m]])  # the same m rows, for the draft context
        return m, reason

    def _plan(self, state, room: int, greedy: bool) -> tuple[int, int, list[int]]:
        """-> (W, K, lookup): W branches of K drafts (a chain: W = 1; K = 0: no draft forward) and the
        prompt-lookup tokens to verify; (1, 0, []) is a plain step. Lookups first (`ngram` mode,
        ngram_assist): a hit replaces the draft, or, forking (greedy), is verified beside it. Greedy
        rounds may branch (`tree_width`). Auto-K chooses (W, K, L) together when the round may branch."""
        lookup, fork = self._lookup(state, room, greedy)
        if lookup and not fork:
            return 1, 0, lookup
        if self.draft is None:
            return 1, 0, lookup
        kd, width = min(self.num_draft, room), self.tree_width if greedy else 1
        if not self.auto:
            return width, kd, lookup
        if not lookup and width == 1:
            return 1, min(self._choose_k(), room), []
        chain = self.acceptance.survival()
        W, K, L = choose_tree(self.cost, chain, self.lookup_acceptance.survival() if lookup else [], kd, len(lookup),
                              self.ranks.shares(chain[0]) if width > 1 else [], width)
        return W, K, lookup[:L]

    def _lookup(self, state, room: int, greedy: bool) -> tuple[list[int], bool]:
        """-> (the prompt-lookup tokens this round may verify, [] without a hit or lookups; whether they
        are verified beside the draft (forking, greedy) rather than instead of it)."""
        fork = greedy and self.forking
        if state.index is None:
            return [], fork
        return state.index.propose(min(self.lookup_k_max if fork else self._choose_k(lookup=True), room)), fork

    def _choose_k(self, lookup: bool = False) -> int:
        """K_max, or auto-K's choice from the measured cost and the recent acceptance, for the
        draft's chain or (`lookup`) for a prompt lookup."""
        k_max = self.lookup_k_max if lookup else self.num_draft
        if not self.auto:
            return k_max
        acceptance = self.lookup_acceptance if lookup else self.acceptance
        return choose_k(self.cost, acceptance.survival(), k_max, lookup=lookup)

    def _learn(self, K: int, n_chain: int, L: int, n_lookup: int, width: int, winner_rank: int) -> None:
        """A round that verified W = `width` draft branches of K drafts (n_chain accepted on the first,
        the draft's best guess; `winner_rank` the 1-based rank of the first token accepted, 0: none)
        and / or a lookup of L tokens (n_lookup accepted) -> each model learns its own part; a model
        whose part was not verified only ages (every round is one step of its window). In `ngram`
        mode the lookup is the draft."""
        if self.mode == "ngram":
            self.acceptance.update(L, n_lookup)
            return
        self.acceptance.update(K, n_chain)
        self.ranks.update(width, winner_rank)
        if self.lookup_acceptance is not None:
            self.lookup_acceptance.update(L, n_lookup)

    def _draft_forward(self, state, x_start, start, K) -> tuple[torch.Tensor, torch.Tensor]:
        """Pending features appended, block forward -> z [K, H], base logits u [K, V] (draft dtype)."""
        return state.drafter.block(self._take_pending(state), x_start, start, K)

    def _cut(self, chain: DraftChain) -> int:
        """A chain of K drafts -> how many to verify: up to where the product of their draft
        confidences drops below `confidence_cut` (all K when the cut is off)."""
        if self.params.confidence_cut <= 0 or chain.confidence is None:
            return chain.tokens.shape[0]
        keep = torch.cumprod(chain.confidence.float(), 0) >= self.params.confidence_cut
        return int(keep.long().cumprod(0).sum())

    def _draft_probs(self, chain: Optional[DraftChain], K: int, V: int,
                     lookup: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [K, V] the drafts were drawn from; a prompt-lookup draft (`lookup` [K]) is a point mass."""
        if K == 0:
            return torch.zeros(0, V, device=self.device)
        if lookup is not None:  # deterministic proposal
            return torch.nn.functional.one_hot(lookup[:K], V).float()
        return chain.probs[:K]

    # ---- helpers ----------------------------------------------------------------------------

    def runners(self, rows: int):
        """A generation of at most `rows` positions -> (target KV runner, draft block runner or None), reset.
        The static ones (CUDA graphs on a GPU) when `static_cache` is on and `rows` fit them, in the
        smallest capacity bucket that holds `rows` (`static_buckets`); else the dynamic ones."""
        graphs = self.cuda_graphs
        if self.static_cache and rows <= self.params.graph_capacity:
            capacity = next(c for c in static_buckets(self.params.graph_capacity, MIN_BUCKET) if c >= rows)
            if capacity not in self._statics:
                rows = max(self.block_size, self.max_verify) + 1
                if self.lean is not None:
                    kv = LeanTargetKV(self.lean, self.layer_ids, capacity, rows, graphs=graphs)
                else:
                    kv = StaticTargetKV(self.model, self.layer_ids, capacity, rows, graphs=graphs)
                drafter = None
                if self.lean_draft is not None:
                    drafter = LeanDraftBlock(self.lean_draft, self.draft_lm_head, self.embed_tokens, self.mask_embeds,
                                             capacity, graphs=graphs)
                elif self.draft is not None:
                    drafter = StaticDraftBlock(self.draft, self.draft_lm_head, self.embed_tokens, self.mask_embeds,
                                               capacity, graphs=graphs)
                self._statics[capacity] = (kv, drafter)
            self._static = self._statics[capacity]
            kv, drafter = self._static
        else:
            kv = DynamicTargetKV(self.model, self.layer_ids)
            drafter = None
            if self.draft is not None:
                drafter = DynamicDraftBlock(self.draft, self.draft_lm_head, self.embed_tokens, self.mask_embeds)
        kv.reset()
        if drafter is not None:
            drafter.reset()
        return kv, drafter

    def graph_failures(self) -> dict[str, str]:
        """Shapes whose CUDA-graph capture failed (they run eagerly) -> the error, by runner, capacity and shape."""
        failures = {}
        for capacity, pair in self._statics.items():
            for name, runner in zip(("target", "draft"), pair):
                if runner is not None:
                    failures.update({f"{name} {capacity} {key}": err for key, err in runner.graphs.failures.items()})
        if self.head is not None and self.head.graphs is not None:
            failures.update({f"head rollout {key}": err for key, err in self.head.graphs.graphs.failures.items()})
        if self.grower is not None:
            failures.update({f"tree build {key}": err for key, err in self.grower.graphs.failures.items()})
        return failures

    def _take_pending(self, state) -> Optional[torch.Tensor]:
        """Pending feature rows -> one tensor [1, S, n*H] (None when there are none), emptied."""
        if not state.pending:
            return None
        features = state.pending[0] if len(state.pending) == 1 else torch.cat(state.pending, dim=1)
        state.pending.clear()
        return features

    def _flush(self, state) -> None:
        """Append any pending feature rows to the draft context."""
        features = self._take_pending(state)
        if features is not None:
            state.drafter.extend(features)

    def _admit(self, tokens: list[int], proposed: list[int], budget: int) -> tuple[int, Optional[str]]:
        """How many of `proposed` may follow `tokens` -> (count, finish reason or None)."""
        room = budget - len(tokens)
        stop = first_stop_token(proposed[:room], self.stop_ids)
        if stop is not None:
            return stop + 1, "stop_token"
        if len(proposed) >= room:
            return room, "length"
        return len(proposed), None

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


def static_buckets(capacity: int, smallest: int = MIN_BUCKET) -> list[int]:
    """Capacities of the static caches, ascending: `smallest`, doubling, up to `capacity` (the last).
    Every forward on a static cache attends over all of its rows (masked), which is what a step costs
    on a GPU in fp32 (H200, SmolLM2: 3.7 ms at 256 rows, 16.6 ms at 4,096), so a generation runs on the
    smallest bucket that holds it. Each bucket is built, and its graphs captured, when first used."""
    buckets, rows = [], smallest
    while rows < capacity:
        buckets.append(rows)
        rows *= 2
    return buckets + [capacity]


class _State:
    """Per-generation runners: target KV, draft block (its context), features not yet appended to it, n-gram index."""

    def __init__(self, kv, drafter, clock: PhaseClock):
        self.kv, self.drafter = kv, drafter  # engine.target_kv / engine.draft_block runners
        self.pending: list[torch.Tensor] = []  # [1, rows, n*H] each; drafter.length + rows == kv.length
        self.index: Optional[NgramIndex] = None
        self.clock = clock  # the rounds' phase times (engine.clock)
