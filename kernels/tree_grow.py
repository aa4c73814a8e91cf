"""DominoTree's build on the kernels: the best-first draft tree's frontiers, four launches a depth.

The tree (engine.domino_tree, whose `grow_tree` is the torch reference): the frontier at depth d is
the (at most) N best children of the frontier at depth d - 1, a node's score being its path's
cumulative draft log-probability. Slot j offers the children of the depth-j frontier:

    j < P:   log q = log_softmax(u_j)                                  the same for every path
    j >= P:  log q = log_softmax(u_j[pool] + W2[pool] · SiLU(W1 · [z_j ; s_path]))

with s_path the GRU state after [x_start, t_1 .. t_j]. Each frontier row offers its C most likely
tokens; the next frontier is the best min(N, F · C) of the F · C offers.

Per depth j, with F frontier rows (their tokens, scores and parents in frontier j - 1), four launches
and no host sync:
1. **gates(j)**, grid (F, G / BLOCK_G): row i's GRU step, from its parent's state and gh and its
   token's input gates (the [V, 3G] table; the root's parent is the zero state) -> S_j [F, G];
2. one GEMM, S_j · [W1_s | W_hhᵀ] -> [F, r + 3G]: the state's part of W1 · [z ; s] for this slot's
   correction, and gh = W_hh · s, which the children's GRU step reads;
3. **score(j)**, grid (F, SPLIT), corrected slots only: program (i, p) takes COLS pool columns,
   SiLU(W1_z · z_j + W1_s · s_i), the corrected logits, their (max, Σ exp) and its C best
   (logit, pool position);
4. **select(j)**, one program: per row, the logsumexp of its SPLIT partials and its C best of the
   SPLIT · C local ones, each offered at score_i + logit - lse (a pure slot offers score_i + the
   block's top C of log_softmax(u_j)); then the F · C offers sorted (descending, ties to the lower
   row, then the row's better child: the reference's flattened order) and the best n_keep kept:
   the next frontier's tokens, scores and parents.
Every shape is fixed by (K, N, C, M), so a build captures whole in one CUDA graph. After the last
depth, `ancestor_bits` writes every verify row's ancestors as a bitmask in one launch.

Arithmetic is fp32 in the kernels; states, and the GEMM's outputs, are stored in the head's dtype.
The reference rounds the corrected logits to the draft's dtype before its softmax; in bf16 a child
can therefore differ from it at a near-tie (the verify decides either way: greedy decoding stays
exact).

Order: weights and result types, kernels, launchers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dominospec.kernels.gru_cell import gru_update
from dominospec.kernels.head_rollout import HeadWeights

# ---- weights and result -----------------------------------------------------------------------


@dataclass(frozen=True)
class TreeWeights:
    """The head prepared for the build: `head` (HeadWeights, its GRU with the [V, 3G] table) and
    state_proj [G, r + 3G] = [W1_s_t | W_hhᵀ] (W1's state columns and W_hh, transposed), what a
    frontier's states are multiplied by."""

    head: HeadWeights
    state_proj: torch.Tensor


def tree_weights(head: HeadWeights) -> TreeWeights:
    """HeadWeights (with the GRU table) -> TreeWeights: one [G, r + 3G] copy of W1_s and W_hh."""
    assert head.gru.table is not None, "the tree's build reads the GRU input gates from the [V, 3G] table"
    return TreeWeights(head, torch.cat([head.w1_s_t, head.gru.w_hh.t().to(head.w1_s_t.dtype)], dim=1).contiguous())


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
def _gates_kernel(tokens_ptr, parents_ptr, prev_state_ptr, proj_ptr, table_ptr, state_ptr,
                  G, stride_proj, gh_offset, stride_table, BLOCK_G: tl.constexpr):
    """Grid (F, cdiv(G, BLOCK_G)): s_i[slice] of frontier row i, from its parent's state and gh (the
    previous GEMM's columns gh_offset..) and its token's row of the input-gate table."""
    i = tl.program_id(0)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    token = tl.load(tokens_ptr + i).to(tl.int64)
    parent = tl.load(parents_ptr + i).to(tl.int64)  # -1: the root, whose parent state and gh are zero
    from_parent = offs_g < tl.where(parent >= 0, G, 0)
    p = tl.maximum(parent, 0)
    gh_row = proj_ptr + p * stride_proj + gh_offset
    gh_r = tl.load(gh_row + offs_g, mask=from_parent, other=0.0).to(tl.float32)
    gh_z = tl.load(gh_row + G + offs_g, mask=from_parent, other=0.0).to(tl.float32)
    gh_n = tl.load(gh_row + 2 * G + offs_g, mask=from_parent, other=0.0).to(tl.float32)
    s_prev = tl.load(prev_state_ptr + p * G + offs_g, mask=from_parent, other=0.0).to(tl.float32)
    gi_row = table_ptr + token * stride_table
    gi_r = tl.load(gi_row + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    gi_z = tl.load(gi_row + G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    gi_n = tl.load(gi_row + 2 * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    s = gru_update(gi_r, gi_z, gi_n, gh_r, gh_z, gh_n, s_prev)
    tl.store(state_ptr + i * G + offs_g, s.to(state_ptr.dtype.element_ty), mask=mask_g)


@triton.jit
def _score_kernel(proj_ptr, stride_proj, zproj_ptr, w2_ptr, stride_w2, base_ptr, ids_ptr, M, r,
                  part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr,
                  C: tl.constexpr, BLOCK_C: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (F, SPLIT): row i's corrected logits over pool columns [p·COLS, (p+1)·COLS) -> part_max,
    part_sum [F, SPLIT] (max, Σ exp(x - max)) and part_val, part_pos [F, SPLIT, C] (its C best logits,
    best first, ties to the lower pool position, and their positions)."""
    i = tl.program_id(0)
    sp = tl.program_id(1)
    n_split = tl.num_programs(1)
    offs = sp * COLS + tl.arange(0, COLS)
    mask = offs < M
    vocab = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
    logits = tl.load(base_ptr + vocab, mask=mask, other=0.0).to(tl.float32)
    for k0 in range(0, r, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < r
        h = tl.load(proj_ptr + i * stride_proj + offs_k, mask=mask_k, other=0.0).to(tl.float32) + \
            tl.load(zproj_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        mid = h * tl.sigmoid(h)  # SiLU; masked lanes are 0
        w = tl.load(w2_ptr + vocab[:, None] * stride_w2 + offs_k[None, :], mask=mask[:, None] & mask_k[None, :],
                    other=0.0, eviction_policy="evict_last")  # the pool's rows, read again by every row
        logits += tl.sum(w.to(tl.float32) * mid[None, :], axis=1)
    logits = tl.where(mask, logits, float("-inf"))
    best = tl.max(logits, axis=0)
    part = i * n_split + sp
    tl.store(part_max_ptr + part, best)
    tl.store(part_sum_ptr + part, tl.sum(tl.exp(logits - best), axis=0))
    offs_c = tl.arange(0, BLOCK_C)
    vals = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
    pos = tl.zeros([BLOCK_C], dtype=tl.int32)
    for c in tl.static_range(C):
        top = tl.max(logits, axis=0)
        at = tl.min(tl.where(logits == top, offs, 2 ** 30), axis=0)
        vals = tl.where(offs_c == c, top, vals)
        pos = tl.where(offs_c == c, at, pos)
        logits = tl.where(offs == at, float("-inf"), logits)
    tl.store(part_val_ptr + part * C + offs_c, vals, mask=offs_c < C)
    tl.store(part_pos_ptr + part * C + offs_c, pos, mask=offs_c < C)


@triton.jit
def _select_kernel(part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr, n_split, score_ptr, ids_ptr, M,
                   pure_val_ptr, pure_tok_ptr, F, n_keep, parent_base, depth, offer_val_ptr, offer_tok_ptr,
                   tokens_ptr, scores_ptr, depth_ptr, frontier_parent_ptr, parent_ptr,
                   PURE: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr,
                   BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: every row's C offers (module docstring), then the n_keep best offers, best first
    -> the next frontier's tokens, scores, depth, frontier parents, and parents as concatenation
    indices (parent_base + frontier parent; parent_base < 0: the root's children, parent -1).
    offer_* [BLOCK_F * BLOCK_C] is scratch: offer row * BLOCK_C + c."""
    rows = tl.arange(0, BLOCK_F)
    mask_f = rows < F
    cols = tl.arange(0, BLOCK_C)
    mask_c = cols < C
    score = tl.load(score_ptr + rows, mask=mask_f, other=float("-inf"))
    if PURE:
        vals = score[:, None] + tl.load(pure_val_ptr + cols, mask=mask_c, other=float("-inf"))[None, :]
        toks = tl.load(pure_tok_ptr + cols, mask=mask_c, other=0).to(tl.int64)[None, :] + \
            tl.zeros([BLOCK_F, BLOCK_C], dtype=tl.int64)
    else:
        splits = tl.arange(0, BLOCK_S)
        mask_s = mask_f[:, None] & (splits < n_split)[None, :]
        part_max = tl.load(part_max_ptr + rows[:, None] * n_split + splits[None, :], mask=mask_s, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + rows[:, None] * n_split + splits[None, :], mask=mask_s, other=0.0)
        row_max = tl.where(mask_f, tl.max(part_max, axis=1), 0.0)
        total = tl.sum(part_sum * tl.exp(part_max - row_max[:, None]), axis=1)
        lse = row_max + tl.log(tl.where(mask_f, total, 1.0))  # rows past F: 0
        local = tl.arange(0, BLOCK_L)
        mask_l = mask_f[:, None] & (local < n_split * C)[None, :]
        v = tl.load(part_val_ptr + rows[:, None] * (n_split * C) + local[None, :], mask=mask_l, other=float("-inf"))
        pos = tl.load(part_pos_ptr + rows[:, None] * (n_split * C) + local[None, :], mask=mask_l, other=2 ** 30)
        vals = tl.full([BLOCK_F, BLOCK_C], float("-inf"), dtype=tl.float32)
        toks = tl.zeros([BLOCK_F, BLOCK_C], dtype=tl.int64)
        for c in tl.static_range(C):  # the row's best, best first; ties to the lower pool position
            top = tl.max(v, axis=1)
            at = tl.min(tl.where(v == top[:, None], pos, 2 ** 30), axis=1)
            tok = tl.load(ids_ptr + at, mask=mask_f & (at < M), other=0).to(tl.int64)
            vals = tl.where(cols[None, :] == c, (score + (top - lse))[:, None], vals)
            toks = tl.where(cols[None, :] == c, tok[:, None], toks)
            v = tl.where(pos == at[:, None], float("-inf"), v)
    offer = rows[:, None] * BLOCK_C + cols[None, :]
    tl.store(offer_val_ptr + offer, vals, mask=mask_f[:, None] & mask_c[None, :])
    tl.store(offer_tok_ptr + offer, toks, mask=mask_f[:, None] & mask_c[None, :])
    tl.debug_barrier()  # the offers, written by every thread, are read back in sorted order
    offs = tl.arange(0, BLOCK_F * BLOCK_C)
    mask = (offs // BLOCK_C < F) & (offs % BLOCK_C < C)
    value = tl.load(offer_val_ptr + offs, mask=mask, other=float("-inf"))
    bits = value.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 order = float order (NaN-free)
    low = 4294967295 - offs.to(tl.int64)
    packed = key.to(tl.int64) * 4294967296 + low  # value, then the lower offer
    packed = tl.where(mask, packed, -9223372036854775807 - 1)  # padding sorts last
    packed = tl.sort(packed, descending=True)
    keep = offs < n_keep
    idx = tl.where(keep, 4294967295 - (packed & 4294967295), 0)
    tl.store(tokens_ptr + offs, tl.load(offer_tok_ptr + idx, mask=keep, other=0), mask=keep)
    tl.store(scores_ptr + offs, tl.load(offer_val_ptr + idx, mask=keep, other=0.0), mask=keep)
    tl.store(depth_ptr + offs, tl.full([BLOCK_F * BLOCK_C], depth, dtype=tl.int64), mask=keep)
    frontier_parent = idx // BLOCK_C
    tl.store(frontier_parent_ptr + offs, frontier_parent, mask=keep)
    parent = tl.where(parent_base < 0, -1, parent_base + frontier_parent)
    tl.store(parent_ptr + offs, parent, mask=keep)


@triton.jit
def _ancestors_kernel(parents_ptr, bits_ptr, T, steps, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    """One program: bits [T, W] int64, row i's own bit, then `steps` passes of bits = own | bits[parent]."""
    rows = tl.arange(0, BLOCK_T)
    mask_t = rows < T
    words = tl.arange(0, BLOCK_W)
    mask = mask_t[:, None] & (words < W)[None, :]
    parent = tl.load(parents_ptr + rows, mask=mask_t, other=0).to(tl.int64)
    one = tl.full([BLOCK_T], 1, dtype=tl.int64)
    own = tl.where(words[None, :] == (rows // 64)[:, None], (one << (rows % 64).to(tl.int64))[:, None], 0)
    tl.store(bits_ptr + rows[:, None] * W + words[None, :], own, mask=mask)
    for _ in range(steps):  # after d passes every row of depth <= d holds its whole path
        tl.debug_barrier()
        up = tl.load(bits_ptr + parent[:, None] * W + words[None, :], mask=mask, other=0)
        tl.debug_barrier()
        tl.store(bits_ptr + rows[:, None] * W + words[None, :], own | up, mask=mask)


# ---- launchers --------------------------------------------------------------------------------


def ancestor_bits(parents: torch.Tensor, steps: int) -> torch.Tensor:
    """Parent row of each row [T] (row 0 its own, a parent before its child) -> [T, ceil(T / 64)]
    int64 bitmasks (row i sees row j iff j is i or an ancestor of i), in one launch: what
    engine.domino_tree.ancestor_bits computes with 2 · steps launches. `steps` >= the deepest depth."""
    T = parents.shape[0]
    W = -(-T // 64)
    bits = torch.empty(T, W, dtype=torch.long, device=parents.device)
    _ancestors_kernel[(1,)](parents, bits, T, steps, W=W, BLOCK_T=triton.next_power_of_2(T),
                            BLOCK_W=triton.next_power_of_2(W), num_warps=4)
    return bits


def tree_levels(weights: TreeWeights, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                pool_ids: Optional[torch.Tensor], nodes: int, children: int) -> TreeLevels:
    """z [K, H], u [K, V] (last dim contiguous), x_start [1] (long), pool ids [M] (long, on device;
    None: the whole vocabulary) -> TreeLevels of every frontier (module docstring), greedy. The same
    nodes as engine.domino_tree.grow_tree's levels up to fp32 summation order."""
    head = weights.head
    K, P, gru = z.shape[0], head.pure_draft_prefix_len, head.gru
    if pool_ids is None:  # the whole vocabulary (no pool, or no corrected slot: K <= P)
        pool_ids = torch.arange(base_logits.shape[1], device=z.device)
    assert base_logits.stride(-1) == 1 and pool_ids.dim() == 1 and pool_ids.is_contiguous()
    G, r, M = gru.w_hh.shape[1], head.w2.shape[1], pool_ids.numel()
    device, dtype = z.device, weights.state_proj.dtype
    cols = min(256, triton.next_power_of_2(M))  # pool columns a score program takes
    n_split = triton.cdiv(M, cols)
    block_k = max(1, min(triton.next_power_of_2(r), 4096 // cols))  # [cols, block_k] W2 tiles: 4k elements
    offers = offered(K, P, children, base_logits.shape[1], M)
    sizes = frontier_sizes(nodes, offers)
    S, widest = sum(sizes), max([1] + sizes[:-1])
    tokens = torch.empty(S, dtype=torch.long, device=device)
    scores = torch.empty(S, dtype=torch.float32, device=device)
    depth = torch.empty(S, dtype=torch.long, device=device)
    parent = torch.empty(S, dtype=torch.long, device=device)
    block_c = triton.next_power_of_2(max(offers))
    offer_val = torch.empty(triton.next_power_of_2(widest) * block_c, dtype=torch.float32, device=device)
    offer_tok = torch.empty(offer_val.shape, dtype=torch.long, device=device)
    part_max = torch.empty(widest * n_split, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_val = torch.empty(widest * n_split * max(offers), dtype=torch.float32, device=device)
    part_pos = torch.empty(part_val.shape, dtype=torch.int32, device=device)
    z_proj = F.linear(z.to(head.w1_z.dtype), head.w1_z)  # [K, r], all slots in one GEMM
    pure_val, pure_tok = torch.log_softmax(base_logits[:max(P, 1)].float(), dim=-1).topk(offers[0], dim=-1)  # [P', C_0]

    frontier_tokens, frontier_parent = x_start.reshape(1), torch.full((1,), -1, dtype=torch.long, device=device)
    frontier_scores = torch.zeros(1, dtype=torch.float32, device=device)
    prev_state = prev_proj = torch.zeros(1, 1, dtype=dtype, device=device)  # unread: the root has no parent
    at, prev_at = 0, -1
    for j in range(K):
        F_j, C, pure = frontier_tokens.shape[0], offers[j], j < P
        state = torch.empty(F_j, G, dtype=dtype, device=device)
        _gates_kernel[(F_j, triton.cdiv(G, 128))](
            frontier_tokens, frontier_parent, prev_state, prev_proj, gru.table, state,
            G, prev_proj.stride(0), r, gru.table.stride(0), BLOCK_G=min(128, triton.next_power_of_2(G)))
        proj = torch.mm(state, weights.state_proj)  # [F, r + 3G]: W1_s · s, then W_hh · s
        if not pure:
            _score_kernel[(F_j, n_split)](
                proj, proj.stride(0), z_proj[j], head.w2, head.w2.stride(0), base_logits[j], pool_ids, M, r,
                part_val, part_pos, part_max, part_sum, C=C, BLOCK_C=triton.next_power_of_2(C), COLS=cols,
                BLOCK_K=block_k, num_warps=4)
        n_keep = sizes[j]
        next_parent = torch.empty(n_keep, dtype=torch.long, device=device)  # index into this frontier
        row = min(j, pure_val.shape[0] - 1)
        _select_kernel[(1,)](
            part_val, part_pos, part_max, part_sum, n_split, frontier_scores, pool_ids, M,
            pure_val[row], pure_tok[row], F_j, n_keep, prev_at, j + 1, offer_val, offer_tok,
            tokens[at:], scores[at:], depth[at:], next_parent, parent[at:],
            PURE=pure, C=C, BLOCK_C=block_c, BLOCK_F=triton.next_power_of_2(F_j),
            BLOCK_L=triton.next_power_of_2(n_split * C), BLOCK_S=triton.next_power_of_2(n_split),
            num_warps=8)
        prev_state, prev_proj, frontier_parent = state, proj, next_parent
        frontier_tokens, frontier_scores = tokens[at:at + n_keep], scores[at:at + n_keep]
        prev_at, at = at, at + n_keep
    return TreeLevels(tokens=tokens, scores=scores, depth=depth, parent=parent)
