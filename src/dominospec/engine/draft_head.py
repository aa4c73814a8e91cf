"""The draft's proposal for one block (docs/design.md §1.3): z [K, H] (final normed draft states; slot j
predicts x[start+1+j]), u = lm_head(z) [K, V] and x_start [1] -> a chain of K tokens. Head off (`dflash`):
d_j drawn from u_j alone; head on: slot j >= P draws from u_j + W2 . SiLU(W1 . [z_j ; s_j]), s_j the GRU
state after [x_start, d_1..d_j]. The model's `rollout` is the torch reference, `kernels.head_rollout` its
fast path; the greedy rollout on the kernels and the sampled chain replay on the one holder
(engine.graphs.DraftGraphs: "head rollout", "sampled chain").
A candidate pool M (0 < M < V) scores the corrected steps over topk(max_{j >= P} u_j, M) only (q = 0
outside); only the verify must be exact. Sampled, q_j [K, V] is exactly the distribution d_j was drawn
from; confidence[j] = q_j(d_j). Which ops run is chosen once (`HeadOps`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from dominospec.engine.sampling import Sampling
from dominospec.errors import UserError

if TYPE_CHECKING:
    from dominospec.engine.decoding import Decoding
    from dominospec.engine.graphs import DraftGraphs

# The head's GRU input gates as a [V, 3G] table gathered by token id replace streaming W_ih (3G·H) every
# step (Qwen3-8B shapes: 0.93 GB in bf16); past this budget the kernels take a GEMV a step instead.
GRU_TABLE_BUDGET_BYTES = 2 << 30


@dataclass
class DraftChain:
    """A drafted chain of K tokens."""

    tokens: torch.Tensor  # [K] long
    probs: Optional[torch.Tensor]  # [K, V] float32 when sampling, else None
    confidence: Optional[torch.Tensor]  # [K] float32: q_j(d_j), or None


def prepare_head_kernels(draft: Any, embed_tokens: Any) -> Any:
    """Domino draft + the target's embedding -> the head prepared once for the Triton kernels
    (`dominospec.kernels.head_rollout.HeadWeights`: W1 split at H, W2, the GRU table) on the draft's device."""
    device = draft.embed_proj[2].weight.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(f"engine.head_kernel: triton runs on CUDA tensors, but the draft is on {device} "
                        "(set TRITON_INTERPRET=1 to run the kernels on CPU, or engine.head_kernel: torch)")
    from dominospec.kernels.head_rollout import head_weights

    gru = draft.prefix_gru
    with torch.no_grad():
        return head_weights(embed_tokens.weight, gru.weight_ih_l0, gru.weight_hh_l0, draft.embed_proj[0].weight,
                            draft.embed_proj[2].weight, draft.config.pure_draft_prefix_len, GRU_TABLE_BUDGET_BYTES)


def candidate_pool(base_logits: torch.Tensor, first: int, pool_size: int) -> Optional[torch.Tensor]:
    """u [K, V] -> ids [M] of the top-M of max over rows first..K-1 (None: full vocabulary)."""
    K, V = base_logits.shape
    if pool_size <= 0 or pool_size >= V or first >= K:
        return None
    best = base_logits[first]  # [V]: the max over rows first..K-1, elementwise (a dim-0 reduction is much slower on CPU)
    for row in base_logits[first + 1:]:
        best = torch.maximum(best, row)
    return torch.topk(best, pool_size, sorted=False).indices  # [M], in no order: the set is what counts (unsorted is faster)


def pooled_head(draft: Any, base_logits: torch.Tensor, cand: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's W2 [V, r] and u [K, V] restricted to the pool `cand` [M] (None: the full
    vocabulary) -> ([M, r], [K, M]), gathered once per block (index_select: a tenth of an advanced
    index's time on CPU). Row m scores token cand[m]. The model's rollout gathers the same way."""
    w2 = draft.embed_proj[2].weight
    if cand is None:
        return w2, base_logits
    return w2.index_select(0, cand), base_logits.index_select(1, cand)


@dataclass(frozen=True)
class HeadOps:
    """How one head drafts a chain, chosen once (as models.lean's DecoderOps are):
    greedy(z [K, H], u [K, V], x_start [1], want) -> DraftChain (`want`: the beliefs q_j(d_j) too);
    sampled(z, u, x_start, sampling, generator) -> DraftChain with q [K, V]; name: which ops."""

    greedy: Callable[..., DraftChain]
    sampled: Callable[..., DraftChain]
    name: str


class DraftHead:
    """One engine's way of drafting a block (module docstring). `corrects`: the Domino head runs;
    `kernels`: the head prepared for the Triton kernels or None; `graphs`: the holder (static caches) or
    None, on which replay the greedy rollouts on the kernels (`rollouts`, pool selection included, one
    workspace for every K) and the sampled chains (`sampled`)."""

    def __init__(self, draft: Any, embed_tokens: Any, corrects: bool, pool_size: int, kernels: Any = None,
                 graphs: Optional[DraftGraphs] = None, rollouts: bool = False, sampled: bool = False):
        self.draft, self.embed_tokens, self.corrects, self.pool_size = draft, embed_tokens, corrects, pool_size
        self.kernels, self.graphs = kernels, graphs
        self.P = int(draft.config.pure_draft_prefix_len)
        self.pool_workspace = graphs.pool_workspace(pool_size) if rollouts else None
        if rollouts:
            graphs.add("head rollout", self.kernel_rollout)
        if sampled:  # the graph draws with the holder's uniforms, filled from the request's generator first
            graphs.add("sampled chain", lambda z, u, x_start, sampling: self.drawn_chain(
                z, u, x_start, sampling, graphs.noise[:z.shape[0]]))
        self.ops = self.choose_ops(rollouts, sampled)

    def choose_ops(self, rollouts: bool, sampled: bool) -> HeadOps:
        """Independent rows (head off); a greedy chain as one graph, on the kernels or on torch ops; a
        sampled chain as one graph, or drawn eagerly."""
        if not self.corrects:
            return HeadOps(lambda z, u, x, want: _draw_rows(u, Sampling(), None, want),
                           lambda z, u, x, sampling, generator: _draw_rows(u, sampling, generator, True), "rows")
        sampled_chain = self.replayed_sample if sampled else self.noisy_chain
        if rollouts:
            return HeadOps(self.replayed_chain, sampled_chain, "graphs")
        if self.kernels is not None:
            return HeadOps(self.kernel_chain, sampled_chain, "kernels")
        return HeadOps(self.torch_chain, sampled_chain, "torch")

    def pool(self, base_logits: torch.Tensor) -> Optional[torch.Tensor]:
        """u [K, V] -> the block's candidate pool ids [M], or None (full vocabulary)."""
        return candidate_pool(base_logits, self.P, self.pool_size)

    def chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, sampling: Sampling,
              generator: Optional[torch.Generator], confidence: bool) -> DraftChain:
        """z [K, H], u [K, V], x_start [1] -> DraftChain of K tokens (`confidence`: greedy chains
        compute q_j(d_j) only when asked, a softmax per step)."""
        if sampling.greedy:
            return self.ops.greedy(z, base_logits, x_start, confidence)
        return self.ops.sampled(z, base_logits, x_start, sampling, generator)

    def kernel_rollout(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                       want: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The greedy rollout on the kernels, pool selection included -> (tokens [K], q_j(d_j) [K] or None)."""
        from dominospec.kernels.head_rollout import head_rollout
        from dominospec.kernels.pool_select import pool_select

        cand = pool_select(base_logits, self.P, self.pool_size, self.pool_workspace)  # [M] ascending, or None
        chain = head_rollout(self.kernels, z, base_logits, x_start, cand, confidence=want)
        return chain.tokens, chain.confidence

    def kernel_chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                     want: bool) -> DraftChain:
        tokens, belief = self.kernel_rollout(z, base_logits, x_start, want)
        return DraftChain(tokens, None, belief)

    def replayed_chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                       want: bool) -> DraftChain:
        """`kernel_chain` replayed on the holder -> copies the caller keeps."""
        tokens, belief = self.graphs.run("head rollout", z, base_logits, x_start, want)
        return DraftChain(tokens.clone(), None, None if belief is None else belief.clone())

    def torch_chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                    want: bool) -> DraftChain:
        if not want:
            out = self.draft.rollout(z, base_logits, x_start, self.embed_tokens, pool=self.pool(base_logits),
                                     keep_logits=False)
            return DraftChain(out.tokens, None, None)
        return self.drawn_chain(z, base_logits, x_start, Sampling(), None)

    def noisy_chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, sampling: Sampling,
                    generator: Optional[torch.Generator]) -> DraftChain:
        """The sampled chain drawn eagerly, its uniforms drawn first."""
        noise = torch.empty(base_logits.shape, dtype=torch.float32, device=base_logits.device)
        return self.drawn_chain(z, base_logits, x_start, sampling, noise.uniform_(generator=generator))

    def replayed_sample(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                        sampling: Sampling, generator: Optional[torch.Generator]) -> DraftChain:
        """The sampled chain replayed on the holder, its uniforms drawn first: the same draws as `noisy_chain`."""
        self.graphs.noise[:z.shape[0]].uniform_(generator=generator)
        return self.graphs.run("sampled chain", z, base_logits, x_start, sampling)

    def drawn_chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, sampling: Sampling,
                    noise: Optional[torch.Tensor]) -> DraftChain:
        """The rollout, each step's draw kept (`_Draws`): greedy, or sampled by the uniforms noise [K, V]
        (row j draws d_j), no host sync. A temperature-only draw runs on the kernels when prepared (the
        same race over a sorted pool: other tokens may win, each drawn from its q exactly)."""
        if self.kernels is not None and noise is not None and sampling.top_k == 0 and sampling.top_p >= 1.0:
            from dominospec.kernels.head_rollout import head_rollout
            from dominospec.kernels.pool_select import pool_select

            cand = pool_select(base_logits, self.P, self.pool_size, self.pool_workspace)
            chain = head_rollout(self.kernels, z, base_logits, x_start, cand, noise=noise,
                                 temperature=sampling.temperature)
            return DraftChain(chain.tokens, chain.probs, chain.confidence)
        cand = self.pool(base_logits)
        draws = _Draws(sampling, noise, base_logits.shape[-1], cand)
        out = self.draft.rollout(z, base_logits, x_start, self.embed_tokens, sampler=draws, pool=cand, keep_logits=False)
        return DraftChain(out.tokens, torch.stack(draws.probs) if draws.probs else None, torch.stack(draws.beliefs))


def draft_head(draft: Any, embed_tokens: Any, decoding: Decoding, graphs: Optional[DraftGraphs]) -> DraftHead:
    """The engine's DraftHead (engine.decoding): chains on the Triton kernels where the resolve step chose
    them; on the holder `graphs` (static caches) the greedy rollouts of a chain engine and, replayed,
    every sampled chain (a tree engine's greedy rounds grow the tree)."""
    d = decoding
    kernels = prepare_head_kernels(draft, embed_tokens) if d.kernels and d.head_chain else None
    rollouts = kernels is not None and graphs is not None and not d.tree
    sampled = d.head_chain and graphs is not None and graphs.enabled
    return DraftHead(draft, embed_tokens, d.head, d.pool, kernels, graphs, rollouts, sampled)


class _Draws:
    """A sampler for the model's rollout (one row) keeping q_j over the vocabulary V (`pool` maps a pooled
    step's M columns back) and q_j(d_j). Step j draws with noise[j] [V]: the exponential race
    d = argmax_i q_i / E_i, E_i = -log U_i ~ Exp(1), picks i with probability q_i exactly (no random op,
    no host sync)."""

    def __init__(self, sampling: Sampling, noise: Optional[torch.Tensor], vocab: int, pool: Optional[torch.Tensor]):
        self.sampling, self.noise, self.vocab, self.pool = sampling, noise, vocab, pool
        self.probs: list[torch.Tensor] = []  # [V] float32 per step (sampling only)
        self.beliefs: list[torch.Tensor] = []  # 0-d float32 per step

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Scored logits [1, N] -> the drawn position [1]."""
        row = logits[0]
        if self.sampling.greedy:
            d = row.float().argmax()  # the same index (exact cast), faster than a bf16 argmax on CPU
            self.beliefs.append(torch.softmax(row.float(), -1)[d])
            return d.reshape(1)
        q = self.sampling.probs(row[None])[0]  # [N] float32
        race = self.noise[len(self.beliefs), :q.shape[0]].log().neg()  # E ~ Exp(1) [N]
        d = (q / race).argmax()
        self.beliefs.append(q[d])
        self.probs.append(q if q.shape[0] == self.vocab else q.new_zeros(self.vocab).index_copy_(0, self.pool, q))
        return d.reshape(1)


def _draw_rows(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator],
               want: bool) -> DraftChain:
    """Logits [K, V] -> one independent draw per row."""
    if sampling.greedy:
        tokens = logits.float().argmax(-1)  # [K]; the same index (exact cast), faster than a bf16 argmax on CPU
        confidence = torch.softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0] if want else None
        return DraftChain(tokens, None, confidence)
    q = sampling.probs(logits)  # [K, V] float32
    tokens = torch.multinomial(q, 1, generator=generator)[:, 0]
    return DraftChain(tokens, q, q.gather(1, tokens[:, None])[:, 0])
