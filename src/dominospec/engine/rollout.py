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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

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
    best = base_logits[first:].max(dim=0).values  # [V]
    return torch.topk(best, pool_size).indices  # [M]


def draft_chain(draft: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, embed_tokens: Any,
                sampling: Sampling, generator: Optional[torch.Generator], head: bool, pool_size: int,
                confidence: bool = True) -> DraftChain:
    """z [K, H], u [K, V], x_start [1] -> DraftChain of K tokens (see module docstring)."""
    K, V = base_logits.shape
    want = confidence or not sampling.greedy
    if not head:  # independent draws: all K rows at once
        return _draw_rows(base_logits, sampling, generator, want)
    P = int(draft.config.pure_draft_prefix_len)
    cand = candidate_pool(base_logits, P, pool_size)
    w2 = draft.embed_proj[2].weight  # [V, r]
    if cand is not None:
        w2, scored_base = w2[cand], base_logits[:, cand]  # [M, r], [K, M]: gathered once per block
    state = draft.gru_step(embed_tokens(x_start), z.new_zeros(1, draft.config.gru_hidden_dim))  # s_0 [1, G]
    tokens, probs, beliefs = [], [], []
    for j in range(K):
        if j < P:  # pure draft slot: the base logits over the full vocabulary
            logits, ids = base_logits[j], None
        else:
            mid = draft.correction_hidden(z[j][None], state)  # [1, r]
            base = base_logits[j] if cand is None else scored_base[j]
            logits, ids = base + F.linear(mid.to(w2.dtype), w2)[0], cand  # [V] or [M]
        d, q_scored, c = _draw(logits, sampling, generator, want)
        token = d if ids is None else ids[d]
        tokens.append(token)
        beliefs.append(c)
        if q_scored is not None:
            probs.append(q_scored if ids is None else q_scored.new_zeros(V).index_copy_(0, ids, q_scored))
        if j + 1 < K:
            state = draft.gru_step(embed_tokens(token.reshape(1)), state)  # s_{j+1} has consumed d_{j+1}
    return DraftChain(torch.stack(tokens).reshape(K), torch.stack(probs) if probs else None,
                      torch.stack(beliefs).reshape(K) if want else None)


def _draw_rows(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator],
               want: bool) -> DraftChain:
    """Logits [K, V] -> one independent draw per row."""
    if sampling.greedy:
        tokens = logits.argmax(-1)  # [K]
        confidence = torch.softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0] if want else None
        return DraftChain(tokens, None, confidence)
    q = sampling.probs(logits)  # [K, V] float32
    tokens = torch.multinomial(q, 1, generator=generator)[:, 0]
    return DraftChain(tokens, q, q.gather(1, tokens[:, None])[:, 0])


def _draw(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator], want: bool):
    """Scored logits [N] -> (index in 0..N-1, warped probs [N] or None when greedy, q(index) or None)."""
    if sampling.greedy:
        d = logits.argmax()
        return d, None, torch.softmax(logits.float(), -1)[d] if want else None
    q = sampling.probs(logits[None])[0]  # [N] float32
    d = torch.multinomial(q[None], 1, generator=generator)[0, 0]
    return d, q, q[d]
