"""The Domino head on the Triton kernels (params `engine.head_kernel: triton`, or `auto` on CUDA): prepared once per engine.

draft (in the draft path's dtype) + the target's embedding -> `HeadWeights` for
`dominospec.kernels`: W1 split at H, W2, and the GRU's input gates either as a [V, 3G] table
gathered by token id or, when the table exceeds `GRU_TABLE_BUDGET_BYTES`, as a GEMV per step.
`RolloutGraphs` replays a greedy rollout (pool selection included: the fused `pool_select`, ids
ascending) as one CUDA graph per K.
triton is imported here, lazily: an engine on the torch path never imports it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from dominospec.errors import UserError

# The [V, 3G] GRU input table replaces streaming W_ih (3G·H) every step. Qwen3-8B shapes: 0.93 GB
# in bf16, which fits; beyond 2 GiB the GEMV path is taken (it reads W_ih + one embedding row).
GRU_TABLE_BUDGET_BYTES = 2 << 30


def triton_usable(device: torch.device) -> bool:
    """`engine.head_kernel: auto` -> Triton here? On a CUDA draft with triton installed (never on
    CPU, where the kernels only run interpreted, for tests)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def prepare_head_kernels(draft: Any, embed_tokens: Any) -> Any:
    """Domino draft + target embedding module -> `dominospec.kernels.head_rollout.HeadWeights` on the draft's device."""
    device = draft.embed_proj[2].weight.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(f"engine.head_kernel: triton runs on CUDA tensors, but the draft is on {device} "
                        "(set TRITON_INTERPRET=1 to run the kernels on CPU, or engine.head_kernel: torch)")
    from dominospec.kernels.head_rollout import head_weights

    gru = draft.prefix_gru
    with torch.no_grad():
        return head_weights(embed_tokens.weight, gru.weight_ih_l0, gru.weight_hh_l0, draft.embed_proj[0].weight,
                            draft.embed_proj[2].weight, draft.config.pure_draft_prefix_len, GRU_TABLE_BUDGET_BYTES)


class RolloutGraphs:
    """The greedy rollout on the kernels (pool selection included) over static inputs, one CUDA graph
    per (K, confidence wanted) (engine.graphs): a chain then costs one replay instead of 2K + 2 kernel
    launches from Python (+ 4 for a pool's selection). With `enabled=False` (CPU, cuda_graphs off) the
    same function runs eagerly. The pool (0 < pool_size < V) is `kernels.pool_select` on one workspace
    shared by every K's graph (replays run one after another on one stream); it needs bf16, fp16 or
    fp32 logits.

    chain(z [K, H], u [K, V], x_start [1]) -> (tokens [K], confidence [K] or None), copies the caller keeps.
    """

    def __init__(self, weights: Any, block_size: int, hidden: int, vocab: int, dtype: torch.dtype,
                 device: torch.device, pool_size: int, enabled: bool, holder: Optional[Any] = None):
        from dominospec.engine.graphs import DraftGraphs

        self.weights, self.pool_size = weights, pool_size
        self.pool = None  # the pool selection's buffers (kernels.pool_select.PoolWorkspace), when there is a pool
        if 0 < pool_size < vocab:
            from dominospec.kernels.pool_select import KEY_BITS, pool_workspace

            if dtype not in KEY_BITS:
                raise UserError(f"engine.candidate_pool with engine.head_kernel: triton selects the pool over "
                                f"bfloat16, float16 or float32 base logits, not {dtype} (set engine.draft_dtype)")
            self.pool = pool_workspace(vocab, pool_size, dtype, device)
        holder = holder or DraftGraphs(block_size, hidden, vocab, dtype, device, enabled)  # the engine's, or its own
        self.inputs = holder.inputs  # static inputs, rows 0..K-1 used
        self.graphs = holder.graphs("head rollout", self._build)

    def _build(self, key: tuple):
        from dominospec.kernels.head_rollout import head_rollout
        from dominospec.kernels.pool_select import pool_select

        P = self.weights.pure_draft_prefix_len
        K, confidence = key

        def rollout():
            z, base, x_start = self.inputs.z[:K], self.inputs.base[:K], self.inputs.x_start
            cand = pool_select(base, P, self.pool_size, self.pool)  # [M] ascending, or None
            chain = head_rollout(self.weights, z, base, x_start, cand, confidence=confidence)
            return chain.tokens, chain.confidence

        return rollout

    def chain(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
              confidence: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        tokens, belief = self.graphs.run((self.inputs.fill(z, base_logits, x_start), confidence))
        return tokens.clone(), None if belief is None else belief.clone()
