"""DominoTree's build on the kernels: the best-first draft tree's frontiers, three launches a depth.

The tree (engine.domino_tree, whose `grow_tree` is the torch reference): the frontier at depth d is
the (at most) N best children of the frontier at depth d - 1, a node's score being its path's
cumulative draft log-probability. Slot j offers the children of the depth-j frontier:

    j < P:   log q = log_softmax(u_j)                                  the same for every path
    j >= P:  log q = log_softmax(u_j[pool] + W2[pool] · SiLU(W1 · [z_j ; s_path]))

with s_path the GRU state after [x_start, t_1 .. t_j]. Each frontier row offers its C most likely
tokens; the next frontier is the best min(N, F · C) of the F · C offers.

Per depth j, three launches and no host sync:
1. gh = S_j · W_hhᵀ [F, 3G] for the frontier's states (a GEMM; it is what the children's GRU step needs
   from their parents, and it does not depend on which children win);
2. **expand(j)**, grid (F,): row i of the frontier first runs its own GRU step, from its parent's state
   and gh and its token's input gates (the [V, 3G] table; the root's parent is the zero state), and
   stores s_i; then W1_s · s_i, SiLU, the corrected logits over the pool (kept in a [F, M] scratch row
   while a running logsumexp goes over them), and the row's C best: offers[i, c] = score_i + log q;
   pure slots (PURE) take the block-wide top C of log_softmax(u_j) instead;
3. **select(j)**, one program: the F · C offers sorted (descending by value, ties to the lower offer,
   as a stable sort) and the best n_keep kept: the depth-(j + 1) frontier's tokens, scores, frontier
   parents, and each node's parent as an index into the concatenation of all depths (-1: x_start).
Every shape is fixed by (K, N, C, M), so a build captures whole in one CUDA graph.

Arithmetic is fp32; states are stored in the GRU's dtype, as the reference rounds them. The reference
rounds the corrected logits to the draft's dtype before its softmax; in bf16 a child can therefore
differ from it at a near-tie (the verify decides either way: greedy decoding stays exact).

Order: result type, kernels, launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dominospec.kernels.head_rollout import HeadWeights

# ---- result -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeLevels:
    """Every depth's frontier, concatenated depth-major (S = Σ_d F_d nodes): tokens [S] long; scores
    [S] fp32 (the path's log-probability); depth [S] long, 1..K; parent [S] long, the parent's index
    in this concatenation (-1: x_start)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor


def offered(K: int, P: int, children: int, vocab: int, pool: int) -> list[int]:
    """Children each row offers at slots 0..K-1: min(C, V) at a pure slot, min(C, M) at a corrected one
    (the reference offers min(children, the columns it scores))."""
    return [min(children, vocab if j < P else pool) for j in range(K)]


def frontier_sizes(nodes: int, offers: list[int]) -> list[int]:
    """Rows of the frontiers at depths 1..K: F_1 = min(N, C_0), F_{d+1} = min(N, F_d · C_d)."""
    sizes, rows = [], 1
    for c in offers:
        rows = min(nodes, rows * c)
        sizes.append(rows)
    return sizes


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _expand_kernel(
    tokens_ptr, parents_ptr, prev_state_ptr, gh_ptr, table_ptr, state_ptr, score_ptr,
    zproj_ptr, w1s_t_ptr, w2_ptr, base_ptr, ids_ptr, scratch_ptr, pure_val_ptr, pure_tok_ptr,
    offer_val_ptr, offer_tok_ptr,
    G, r, M, stride_table, stride_w2,
    PURE: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_POOL: tl.constexpr,
):
    """Grid (F,): frontier row i's GRU step (-> state_ptr[i]), then its C offers (-> offer_*[i])."""
    i = tl.program_id(0)
    token = tl.load(tokens_ptr + i).to(tl.int64)
    parent = tl.load(parents_ptr + i).to(tl.int64)  # -1: the root, whose parent state and gh are zero
    parent_cols = tl.where(parent >= 0, G, 0)  # columns read from the parent: none for the root
    p = tl.maximum(parent, 0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < r
    h = tl.zeros([BLOCK_R], dtype=tl.float32)  # W1_s · s_i
    for g0 in range(0, G, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        mask_g = offs_g < G
        from_parent = offs_g < parent_cols
        gh_row = gh_ptr + p * 3 * G
        gh_r = tl.load(gh_row + offs_g, mask=from_parent, other=0.0).to(tl.float32)
        gh_z = tl.load(gh_row + G + offs_g, mask=from_parent, other=0.0).to(tl.float32)
        gh_n = tl.load(gh_row + 2 * G + offs_g, mask=from_parent, other=0.0).to(tl.float32)
        s_prev = tl.load(prev_state_ptr + p * G + offs_g, mask=from_parent, other=0.0).to(tl.float32)
        gi_row = table_ptr + token * stride_table
        gi_r = tl.load(gi_row + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        gi_z = tl.load(gi_row + G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        gi_n = tl.load(gi_row + 2 * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        rg = tl.sigmoid(gi_r + gh_r)
        zg = tl.sigmoid(gi_z + gh_z)
        ng = 2.0 * tl.sigmoid(2.0 * (gi_n + rg * gh_n)) - 1.0  # tanh(x) = 2σ(2x) - 1
        s = ((1.0 - zg) * ng + zg * s_prev).to(state_ptr.dtype.element_ty)  # rounded as stored
        tl.store(state_ptr + i * G + offs_g, s, mask=mask_g)
        if not PURE:
            w1 = tl.load(w1s_t_ptr + offs_g[:, None] * r + offs_r[None, :],
                         mask=mask_g[:, None] & mask_r[None, :], other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_R]
            h += tl.sum(w1 * s.to(tl.float32)[:, None], axis=0)
    score = tl.load(score_ptr + i)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    if PURE:
        vals = score + tl.load(pure_val_ptr + offs_c, mask=mask_c, other=float("-inf"))
        toks = tl.load(pure_tok_ptr + offs_c, mask=mask_c, other=0)
    else:
        h += tl.load(zproj_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        mid = h * tl.sigmoid(h)  # SiLU [BLOCK_R]; masked lanes are 0
        run_max = float("-inf")
        run_sum = 0.0
        for m0 in range(0, M, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            vocab = tl.load(ids_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            logits = tl.load(base_ptr + vocab, mask=mask_m, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + vocab[:, None] * stride_w2 + offs_r[None, :],
                        mask=mask_m[:, None] & mask_r[None, :], other=0.0, eviction_policy="evict_last")
            logits += tl.sum(w.to(tl.float32) * mid[None, :], axis=1)
            logits = tl.where(mask_m, logits, float("-inf"))
            tl.store(scratch_ptr + i * M + offs_m, logits, mask=mask_m)
            new_max = tl.maximum(run_max, tl.max(logits, axis=0))
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
            run_max = new_max
        lse = run_max + tl.log(run_sum)
        tl.debug_barrier()  # the row's logits, written by every thread, are read back whole
        offs_p = tl.arange(0, BLOCK_POOL)
        x = tl.load(scratch_ptr + i * M + offs_p, mask=offs_p < M, other=float("-inf"))
        vals = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
        toks = tl.zeros([BLOCK_C], dtype=tl.int64)
        for c in tl.static_range(C):  # the C best, best first; ties to the lower pool position
            best = tl.max(x, axis=0)
            pos = tl.min(tl.where(x == best, offs_p, BLOCK_POOL), axis=0)
            vals = tl.where(offs_c == c, best, vals)
            toks = tl.where(offs_c == c, tl.load(ids_ptr + pos).to(tl.int64), toks)
            x = tl.where(offs_p == pos, float("-inf"), x)
        vals = score + (vals - lse)
    tl.store(offer_val_ptr + i * C + offs_c, vals, mask=mask_c)
    tl.store(offer_tok_ptr + i * C + offs_c, toks.to(tl.int64), mask=mask_c)


@triton.jit
def _select_kernel(offer_val_ptr, offer_tok_ptr, n_offers, n_keep, parent_base, depth,
                   tokens_ptr, scores_ptr, depth_ptr, frontier_parent_ptr, parent_ptr,
                   C: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the n_keep best of n_offers offers, best first (ties to the lower offer index) ->
    the next frontier's tokens, scores, depth, frontier parents, and parents as concatenation indices
    (parent_base + frontier parent; parent_base < 0: the root's children, parent -1)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n_offers
    v = tl.load(offer_val_ptr + offs, mask=mask, other=float("-inf"))
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 order = float order (NaN-free)
    low = 4294967295 - offs.to(tl.int64)
    packed = key.to(tl.int64) * 4294967296 + low  # value, then the lower offer
    packed = tl.where(mask, packed, -9223372036854775807 - 1)  # padding sorts last
    packed = tl.sort(packed, descending=True)
    keep = offs < n_keep
    idx = tl.where(keep, 4294967295 - (packed & 4294967295), 0)
    tl.store(tokens_ptr + offs, tl.load(offer_tok_ptr + idx, mask=keep, other=0), mask=keep)
    tl.store(scores_ptr + offs, tl.load(offer_val_ptr + idx, mask=keep, other=0.0), mask=keep)
    tl.store(depth_ptr + offs, tl.full([BLOCK], depth, dtype=tl.int64), mask=keep)
    frontier_parent = idx // C
    tl.store(frontier_parent_ptr + offs, frontier_parent, mask=keep)
    parent = tl.where(parent_base < 0, -1, parent_base + frontier_parent)
    tl.store(parent_ptr + offs, parent, mask=keep)


# ---- launcher ---------------------------------------------------------------------------------


def tree_levels(weights: HeadWeights, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                pool_ids: Optional[torch.Tensor], nodes: int, children: int, num_warps: int = 4) -> TreeLevels:
    """z [K, H], u [K, V] (last dim contiguous), x_start [1] (long), pool ids [M] (long, on device) ->
    TreeLevels of every frontier (module docstring), greedy. `pool_ids` None: the whole vocabulary,
    held in registers a row (meant for small vocabularies, or K <= P where no slot is corrected). Needs the GRU's [V, 3G] table. The same
    nodes as engine.domino_tree.grow_tree's levels up to fp32 summation order."""
    K = z.shape[0]
    gru, P = weights.gru, weights.pure_draft_prefix_len
    assert gru.table is not None, "tree_levels reads the GRU input gates from the [V, 3G] table"
    if pool_ids is None:  # the whole vocabulary (no pool, or no corrected slot: K <= P)
        pool_ids = torch.arange(base_logits.shape[1], device=z.device)
    assert base_logits.stride(-1) == 1 and pool_ids.dim() == 1 and pool_ids.is_contiguous()
    G, r, M = gru.w_hh.shape[1], weights.w2.shape[1], pool_ids.numel()
    device = z.device
    block_r = triton.next_power_of_2(r)
    tile = max(8, 4096 // block_r)  # rows of a [rows, r] weight tile: 4k fp32 elements, 32 a thread
    offers = offered(K, P, children, base_logits.shape[1], M)
    sizes = frontier_sizes(nodes, offers)
    S = sum(sizes)
    tokens = torch.empty(S, dtype=torch.long, device=device)
    scores = torch.empty(S, dtype=torch.float32, device=device)
    parent = torch.empty(S, dtype=torch.long, device=device)
    depth = torch.empty(S, dtype=torch.long, device=device)
    scratch = torch.empty(max([1] + sizes[:-1]), M, dtype=torch.float32, device=device)  # a row's logits
    z_proj = F.linear(z.to(weights.w1_z.dtype), weights.w1_z)  # [K, r], all slots in one GEMM
    pure_val, pure_tok = torch.log_softmax(base_logits[:max(P, 1)].float(), dim=-1).topk(offers[0], dim=-1)  # [P, C_0]

    frontier_tokens, frontier_parent = x_start.reshape(1), torch.full((1,), -1, dtype=torch.long, device=device)
    frontier_scores = torch.zeros(1, dtype=torch.float32, device=device)
    prev_state = torch.zeros(1, G, dtype=gru.w_hh.dtype, device=device)  # unread: the root has no parent
    gh = torch.zeros(1, 3 * G, dtype=gru.w_hh.dtype, device=device)
    offers_val = torch.empty(max(f * c for f, c in zip([1] + sizes[:-1], offers)), dtype=torch.float32, device=device)
    offers_tok = torch.empty_like(offers_val, dtype=torch.long)
    at, prev_at = 0, -1
    for j in range(K):
        F_j = frontier_tokens.shape[0]
        state = torch.empty(F_j, G, dtype=gru.w_hh.dtype, device=device)
        pure, C = j < P, offers[j]
        _expand_kernel[(F_j,)](
            frontier_tokens, frontier_parent, prev_state, gh, gru.table, state, frontier_scores,
            z_proj[j], weights.w1_s_t, weights.w2, base_logits[j], pool_ids, scratch,
            pure_val[min(j, pure_val.shape[0] - 1)], pure_tok[min(j, pure_tok.shape[0] - 1)],
            offers_val, offers_tok, G, r, M, gru.table.stride(0), weights.w2.stride(0),
            PURE=pure, C=C, BLOCK_C=triton.next_power_of_2(C), BLOCK_G=min(tile, triton.next_power_of_2(G)),
            BLOCK_R=block_r, BLOCK_M=min(tile, triton.next_power_of_2(M)),
            BLOCK_POOL=triton.next_power_of_2(M), num_warps=num_warps,
        )
        n_keep = sizes[j]
        next_parent = torch.empty(n_keep, dtype=torch.long, device=device)  # index into this frontier
        _select_kernel[(1,)](
            offers_val, offers_tok, F_j * C, n_keep, prev_at, j + 1,
            tokens[at:], scores[at:], depth[at:], next_parent, parent[at:],
            C=C, BLOCK=triton.next_power_of_2(F_j * C),
        )
        if j + 1 < K:
            gh = torch.mm(state, gru.w_hh.t())  # [F_j, 3G]: the children's GRU step reads their parent's row
            prev_state, frontier_parent = state, next_parent
            frontier_tokens, frontier_scores = tokens[at:at + n_keep], scores[at:at + n_keep]
        prev_at, at = at, at + n_keep
    return TreeLevels(tokens=tokens, scores=scores, depth=depth, parent=parent)
