"""Drafting one block's chain d_1..d_K from the backbone's output, with an optional candidate pool.

Input: z [K, H] (final normed draft states of slots 0..K-1; slot j predicts x[start+1+j]) and the
base logits u = lm_head(z) [K, V], both in the draft path's dtype.

- head off (`dflash`): d_j drawn from u_j independently.
- head on (`domino`): slot j >= P (pure_draft_prefix_len) draws from u_j + W2 . SiLU(W1 . [z_j ; s_j]),
  s_j the GRU state after [x_start, d_1..d_j] (the model's `rollout`, step for step).
- candidate pool (head on, pool_size M > 0; SGLang's `--speculative-domino-candidate-pool-size`):
  the corrected steps score only the M tokens with the highest base logit over those steps,
  `cand = topk(max_{j >= P} u_j, M)`, so a step reads M rows of W2 instead of V. Tokens outside
  the pool get probability 0. M = 0 (or M >= V) is the exact full vocabulary.

Only verification must be exact: a pool, like a bf16 draft, only changes which tokens are
proposed. When sampling, q_j (returned dense, [K, V]) is exactly the distribution d_j was drawn
from, which is what lossless speculative sampling needs. `confidence[j]` is q_j(d_j) (greedy:
the softmax of the scored logits at the argmax), the draft's own belief in d_j; greedy chains
compute it only when asked (`confidence=True`: a softmax per step).

Kernel choice (params `engine.head_kernel`): `kernels=None` runs the torch ops below; prepared
`HeadWeights` (engine.head_kernels) run dominospec.kernels instead: a greedy chain is the whole
on-device rollout (`head_rollout`: no host sync, tokens equal to the torch path in fp32) over the
pool of `pool_select` (the same set as `candidate_pool` unless the M-th value is tied, ids
ascending), a sampled chain scores each step with `correction_logits` over `candidate_pool`'s pool
in its order and draws exactly as the torch path does (the same generator, the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from dominospec.engine.sampling import Sampling


@dataclass
class DraftChain:
    """tokens [K] (long); probs [K, V] float32 when sampling, else None; confidence [K] float32 or None."""

    tokens: torch.Tensor
    probs: Optional[torch.Tensor]
    confidence: Optional[torch.Tensor]


def candidate_pool(base_logits: torch.Tensor, first: int, pool_size: int) -> Optional[torch.Tensor]:
    """u [K, V] -> ids [M] of the top-M of max over rows first..K-1 (None: full vocabulary)."""
    K, V = base_logits.shape
    if pool_size <= 0 or pool_size >= V or first >= K:
        return None
    best = base_logits[first]  # [V]: the max over rows first..K-1, elementwise (a dim-0 reduction is 20x slower on CPU)
    for row in base_logits[first + 1:]:
        best = torch.maximum(best, row)
    return torch.topk(best, pool_size, sorted=False).indices  # [M], in no order: the set is what counts (1.4x faster)


def pooled_head(draft: Any, base_logits: torch.Tensor, cand: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's W2 [V, r] and the base logits u [K, V] restricted to the pool `cand` [M] (None: the full
    vocabulary) -> ([M, r], [K, M]), gathered once per block (index_select: a tenth of an advanced
    index's time on CPU). Row m scores token cand[m]."""
    w2 = draft.embed_proj[2].weight
    if cand is None:
        return w2, base_logits
    return w2.index_select(0, cand), base_logits.index_select(1, cand)


def draft_chain(draft: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, embed_tokens: Any,
                sampling: Sampling, generator: Optional[torch.Generator], head: bool, pool_size: int,
                confidence: bool = True, kernels: Any = None, graphs: Any = None) -> DraftChain:
    """z [K, H], u [K, V], x_start [1] -> DraftChain of K tokens (see module docstring).
    `kernels`: None (torch ops) or the head prepared for the Triton kernels (engine.head_kernels);
    `graphs`: with kernels, their greedy rollout on static buffers (engine.head_kernels.RolloutGraphs)."""
    K, V = base_logits.shape
    want = confidence or not sampling.greedy
    if not head:  # independent draws: all K rows at once
        return _draw_rows(base_logits, sampling, generator, want)
    if graphs is not None and sampling.greedy:  # the whole rollout, pool selection included, as one graph
        tokens, belief = graphs.chain(z, base_logits, x_start, want)
        return DraftChain(tokens, None, belief)
    P = int(draft.config.pure_draft_prefix_len)
    if kernels is not None and sampling.greedy:  # the whole rollout on device, the pool's selection fused
        from dominospec.kernels.head_rollout import head_rollout
        from dominospec.kernels.pool_select import pool_select

        chain = head_rollout(kernels, z, base_logits, x_start, pool_select(base_logits, P, pool_size),
                             confidence=want)
        return DraftChain(chain.tokens, None, chain.confidence)
    cand = candidate_pool(base_logits, P, pool_size)
    steps = (_torch_steps(draft, z, base_logits, x_start, embed_tokens, cand) if kernels is None
             else _kernel_steps(kernels, z, base_logits, x_start, cand, sampling))
    state = steps.start  # s_0 [1, G]
    tokens, probs, beliefs = [], [], []
    for j in range(K):
        if j < P:  # pure draft slot: the base logits over the full vocabulary
            logits, ids = base_logits[j], None
        else:
            logits, ids = steps.score(j, state), cand  # [V] or [M]
        d, q_scored, c = _draw(logits, sampling, generator, want)
        token = d if ids is None else ids[d]
        tokens.append(token)
        beliefs.append(c)
        if q_scored is not None:
            probs.append(q_scored if ids is None else q_scored.new_zeros(V).index_copy_(0, ids, q_scored))
        if j + 1 < K:
            state = steps.advance(token, state)  # s_{j+1} has consumed d_{j+1}
    return DraftChain(torch.stack(tokens).reshape(K), torch.stack(probs) if probs else None,
                      torch.stack(beliefs).reshape(K) if want else None)


class _Steps(NamedTuple):
    """One head path: s_0 [1, G]; score(j, s_j) -> corrected logits of slot j ([V], or [M] over the pool);
    advance(token, s_j) -> s_{j+1}."""

    start: torch.Tensor
    score: Callable[[int, torch.Tensor], torch.Tensor]
    advance: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_steps(draft: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, embed_tokens: Any,
                 cand: Optional[torch.Tensor]) -> _Steps:
    """The head as the model's torch ops."""
    w2, scored_base = pooled_head(draft, base_logits, cand)

    def score(j: int, state: torch.Tensor) -> torch.Tensor:
        mid = draft.correction_hidden(z[j][None], state)  # [1, r]
        return scored_base[j] + F.linear(mid.to(w2.dtype), w2)[0]

    def advance(token: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return draft.gru_step(embed_tokens(token.reshape(1)), state)

    start = draft.gru_step(embed_tokens(x_start), z.new_zeros(1, draft.config.gru_hidden_dim))
    return _Steps(start, score, advance)


def _kernel_steps(kernels: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                  cand: Optional[torch.Tensor], sampling: Sampling) -> _Steps:
    """The head on the Triton kernels: fused GRU cell, W1 as z_proj + W1_s . s, fused SiLU . W2 + u (fp32 row)."""
    from dominospec.kernels.correction_sample import correction_logits
    from dominospec.kernels.gru_cell import gru_cell

    z_proj = F.linear(z.to(kernels.w1_z.dtype), kernels.w1_z)  # [K, r], all slots at once

    def score(j: int, state: torch.Tensor) -> torch.Tensor:
        h = torch.addmv(z_proj[j], kernels.w1_s_t.t(), state[0])[None]  # W1 . [z_j ; s_j], [1, r]
        return correction_logits(h, kernels.w2, base_logits[j:j + 1], cand, sampling.temperature).logits[0]

    def advance(token: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return gru_cell(token.reshape(1), state, kernels.gru)

    zeros = kernels.gru.w_hh.new_zeros(1, kernels.gru.w_hh.shape[1])
    return _Steps(gru_cell(x_start.reshape(1), zeros, kernels.gru), score, advance)


def _draw_rows(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator],
               want: bool) -> DraftChain:
    """Logits [K, V] -> one independent draw per row."""
    if sampling.greedy:
        tokens = logits.float().argmax(-1)  # [K]; the same index (exact cast), 2x faster than a bf16 argmax on CPU
        confidence = torch.softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0] if want else None
        return DraftChain(tokens, None, confidence)
    q = sampling.probs(logits)  # [K, V] float32
    tokens = torch.multinomial(q, 1, generator=generator)[:, 0]
    return DraftChain(tokens, q, q.gather(1, tokens[:, None])[:, 0])


def _draw(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator], want: bool):
    """Scored logits [N] -> (index in 0..N-1, warped probs [N] or None when greedy, q(index) or None)."""
    if sampling.greedy:
        d = logits.float().argmax()  # the same index (exact cast), 2x faster than a bf16 argmax on CPU
        return d, None, torch.softmax(logits.float(), -1)[d] if want else None
    q = sampling.probs(logits[None])[0]  # [N] float32
    d = torch.multinomial(q[None], 1, generator=generator)[0, 0]
    return d, q, q[d]
