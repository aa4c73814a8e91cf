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
3. **score(j)**, grid (F / 16, SPLIT), corrected slots only: program (f, p) takes 16 frontier rows
   and COLS pool columns, SiLU(W1_z · z_j + W1_s · s_i) [16, r] times the pool's W2 rows [r, COLS]
   (one tl.dot: each W2 row read once a row tile, many small programs in flight), the corrected
   logits, each row's (max, Σ exp) and its C best (logit, pool position);
4. **select(j)**, one program: per row, the logsumexp of its SPLIT partials and its C best of the
   SPLIT · C local ones, each offered at score_i + logit - lse; then the F · C offers sorted
   (descending, ties to the lower row, then the row's better child: the reference's flattened
   order) and the best n_keep kept: the next frontier's tokens, scores and parents.
A pure slot (j < P) offers every row the same C children: **pure**, one launch before the depths,
takes each pure slot's base logits in blocks of 1,024 vocabulary columns into the same partials
(max, Σ exp, C best token ids), which the slot's select reads for every row (a full-vocabulary
softmax and top-k would cost about ten launches and 0.08 ms at V = 151,936).
Every shape is fixed by (K, N, C, M), so a build captures whole in one CUDA graph. After the last
depth, `ancestor_bits` writes every verify row's ancestors as a bitmask in one launch.

Arithmetic is fp32 in the kernels (the score's product: exact fp32 on fp32 weights, tf32 on bf16 /
fp16 ones, finer than the head module's own bf16 rounding); states, and the GEMM's outputs, are
stored in the head's dtype.
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
def _top_c(logits, offs, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """logits [R, L] fp32 at column positions offs [L] -> the C best of each row, best first, ties to
    the lower position: (values [R, BLOCK_C], positions [R, BLOCK_C] int32); lanes past C are -inf / 0."""
    offs_c = tl.arange(0, BLOCK_C)
    vals = tl.full([logits.shape[0], BLOCK_C], float("-inf"), dtype=tl.float32)
    pos = tl.zeros([logits.shape[0], BLOCK_C], dtype=tl.int32)
    for c in tl.static_range(C):
        top = tl.max(logits, axis=1)
        at = tl.min(tl.where(logits == top[:, None], offs[None, :], 2 ** 30), axis=1)
        vals = tl.where(offs_c[None, :] == c, top[:, None], vals)
        pos = tl.where(offs_c[None, :] == c, at[:, None], pos)
        logits = tl.where(offs[None, :] == at[:, None], float("-inf"), logits)
    return vals, pos


@triton.jit
def _store_partials(logits, offs, part, mask_rows, part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr,
                    C: tl.constexpr, BLOCK_C: tl.constexpr):
    """logits [R, L] (-inf where masked) of rows whose partial index is part [R] -> part_max, part_sum
    [part] (max, Σ exp(x - max)) and part_val, part_pos [part, C] (`_top_c`)."""
    best = tl.max(logits, axis=1)
    tl.store(part_max_ptr + part, best, mask=mask_rows)
    tl.store(part_sum_ptr + part, tl.sum(tl.exp(logits - best[:, None]), axis=1), mask=mask_rows)
    vals, pos = _top_c(logits, offs, C, BLOCK_C)
    offs_c = tl.arange(0, BLOCK_C)
    keep = mask_rows[:, None] & (offs_c < C)[None, :]
    tl.store(part_val_ptr + part[:, None] * C + offs_c[None, :], vals, mask=keep)
    tl.store(part_pos_ptr + part[:, None] * C + offs_c[None, :], pos, mask=keep)


@triton.jit
def _score_kernel(proj_ptr, stride_proj, zproj_ptr, w2_ptr, stride_w2, base_ptr, ids_ptr, F, M, r,
                  part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr,
                  C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr, COLS: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Grid (cdiv(F, BLOCK_F), SPLIT): the corrected logits of frontier rows [f·BLOCK_F, (f+1)·BLOCK_F)
    over pool columns [p·COLS, (p+1)·COLS), one [BLOCK_F, r] x [r, COLS] product (each W2 row of
    the pool read once a row tile) -> per row (`_store_partials`, partial row·SPLIT + p) its max,
    Σ exp and C best (logit, pool position)."""
    rows = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = rows < F
    sp = tl.program_id(1)
    offs = sp * COLS + tl.arange(0, COLS)
    mask = offs < M
    vocab = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_F, COLS], dtype=tl.float32)
    for k0 in range(0, r, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < r
        h = tl.load(proj_ptr + rows[:, None] * stride_proj + offs_k[None, :], mask=mask_f[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32) + tl.load(zproj_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        mid = h * tl.sigmoid(h)  # SiLU [BLOCK_F, BLOCK_K]; lanes past r are 0
        w = tl.load(w2_ptr + vocab[:, None] * stride_w2 + offs_k[None, :], mask=mask[:, None] & mask_k[None, :],
                    other=0.0, eviction_policy="evict_last")  # the pool's rows [COLS, BLOCK_K], read again each depth
        if w.dtype == tl.float32:
            acc += tl.dot(mid, tl.trans(w), input_precision="ieee")
        else:  # bf16 / fp16 weights: a tf32 product, finer than the head module's own rounding (and
            # Triton's CPU interpreter multiplies bf16 operands wrongly, fp32 ones exactly)
            acc += tl.dot(mid, tl.trans(w.to(tl.float32)), input_precision="tf32")
    base = tl.load(base_ptr + vocab, mask=mask, other=0.0).to(tl.float32)
    logits = tl.where(mask[None, :], base[None, :] + acc, float("-inf"))
    _store_partials(logits, offs, rows * tl.num_programs(1) + sp, mask_f, part_val_ptr, part_pos_ptr, part_max_ptr,
                    part_sum_ptr, C, BLOCK_C)


@triton.jit
def _pure_kernel(base_ptr, stride_base, V, part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr,
                 C: tl.constexpr, BLOCK_C: tl.constexpr, COLS: tl.constexpr):
    """Grid (P', SPLIT): pure slot j's base logits over vocabulary columns [p·COLS, (p+1)·COLS) ->
    its partial j·SPLIT + p (`_store_partials`; positions are token ids)."""
    j = tl.program_id(0)
    sp = tl.program_id(1)
    offs = sp * COLS + tl.arange(0, COLS)
    mask = offs < V
    logits = tl.load(base_ptr + j * stride_base + offs, mask=mask, other=float("-inf")).to(tl.float32)
    part = j * tl.num_programs(1) + sp + tl.zeros([1], dtype=tl.int32)
    _store_partials(logits[None, :], offs, part, part >= 0, part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr,
                    C, BLOCK_C)


@triton.jit
def _select_kernel(part_val_ptr, part_pos_ptr, part_max_ptr, part_sum_ptr, n_split, row_stride, score_ptr, ids_ptr,
                   M, F, n_keep, parent_base, depth, offer_val_ptr, offer_tok_ptr,
                   tokens_ptr, scores_ptr, depth_ptr, frontier_parent_ptr, parent_ptr,
                   PURE: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_F: tl.constexpr,
                   BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: every row's C offers (module docstring), then the n_keep best offers, best first
    -> the next frontier's tokens, scores, depth, frontier parents, and parents as concatenation
    indices (parent_base + frontier parent; parent_base < 0: the root's children, parent -1).
    Row i's partials start at i · row_stride (0: a pure slot's, the same for every row; their
    positions are then token ids, else pool positions, < M). offer_* [BLOCK_F * BLOCK_C] is
    scratch: offer row * BLOCK_C + c."""
    rows = tl.arange(0, BLOCK_F)
    mask_f = rows < F
    cols = tl.arange(0, BLOCK_C)
    mask_c = cols < C
    score = tl.load(score_ptr + rows, mask=mask_f, other=float("-inf"))
    first = rows * row_stride  # [BLOCK_F]
    splits = tl.arange(0, BLOCK_S)
    mask_s = mask_f[:, None] & (splits < n_split)[None, :]
    part_max = tl.load(part_max_ptr + first[:, None] + splits[None, :], mask=mask_s, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + first[:, None] + splits[None, :], mask=mask_s, other=0.0)
    row_max = tl.where(mask_f, tl.max(part_max, axis=1), 0.0)
    total = tl.sum(part_sum * tl.exp(part_max - row_max[:, None]), axis=1)
    lse = row_max + tl.log(tl.where(mask_f, total, 1.0))  # rows past F: 0
    local = tl.arange(0, BLOCK_L)
    mask_l = mask_f[:, None] & (local < n_split * C)[None, :]
    v = tl.load(part_val_ptr + first[:, None] * C + local[None, :], mask=mask_l, other=float("-inf"))
    pos = tl.load(part_pos_ptr + first[:, None] * C + local[None, :], mask=mask_l, other=2 ** 30)
    vals = tl.full([BLOCK_F, BLOCK_C], float("-inf"), dtype=tl.float32)
    toks = tl.zeros([BLOCK_F, BLOCK_C], dtype=tl.int64)
    for c in tl.static_range(C):  # the row's best, best first; ties to the lower position
        top = tl.max(v, axis=1)
        at = tl.min(tl.where(v == top[:, None], pos, 2 ** 30), axis=1)
        if PURE:
            tok = at.to(tl.int64)
        else:
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


SCORE_ROWS = 16  # frontier rows a score program takes (tl.dot's least M)
SCORE_COLS = 64  # pool columns a score program takes, at least: many small programs keep many W2 rows in flight
SELECT_PARTIALS = 16384  # the most partial candidates (rows x blocks x C) the one-program select reads
PURE_COLS = 1024  # vocabulary columns a pure-slot program takes


def score_split(M: int, widest: int, children: int, cols: Optional[int] = None) -> tuple[int, int]:
    """A pool of M columns, frontiers of at most `widest` rows offering C children -> (columns a score
    program takes: a power of two >= 16, `cols` or SCORE_COLS, widened until the select's partials fit
    SELECT_PARTIALS; the column blocks)."""
    need = triton.cdiv(M * children * triton.next_power_of_2(widest), SELECT_PARTIALS)
    cols = max(16, triton.next_power_of_2(max(cols or SCORE_COLS, need)))
    return cols, triton.cdiv(M, cols)


@dataclass(frozen=True)
class PurePartials:
    """The pure slots' partials (`_pure_kernel`): val, pos [P', n_split, C]; max, sum [P', n_split]."""

    val: torch.Tensor
    pos: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor
    n_split: int

    @property
    def n_slots(self) -> int:
        return self.max.shape[0]

    def slot(self, j: int) -> tuple:
        """The select kernel's partial arguments for pure slot j (val, pos, max, sum, n_split)."""
        return self.val[j], self.pos[j], self.max[j], self.sum[j], self.n_split


def pure_partials(base_logits: torch.Tensor, children: int) -> PurePartials:
    """u [P', V] -> each row's partials over blocks of PURE_COLS columns, in one launch: what the
    select turns into the C best of log_softmax(u_j) (a full-vocabulary softmax and top-k otherwise
    cost about ten launches)."""
    P, V = base_logits.shape
    cols = min(PURE_COLS, max(16, triton.next_power_of_2(V)))
    n_split, C = triton.cdiv(V, cols), max(1, min(children, V))
    device = base_logits.device
    out = PurePartials(torch.empty(P, n_split, C, dtype=torch.float32, device=device),
                       torch.empty(P, n_split, C, dtype=torch.int32, device=device),
                       torch.empty(P, n_split, dtype=torch.float32, device=device),
                       torch.empty(P, n_split, dtype=torch.float32, device=device), n_split)
    _pure_kernel[(P, n_split)](base_logits, base_logits.stride(0), V, out.val, out.pos, out.max, out.sum,
                               C=C, BLOCK_C=triton.next_power_of_2(C), COLS=cols, num_warps=4)
    return out


def tree_levels(weights: TreeWeights, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                pool_ids: Optional[torch.Tensor], nodes: int, children: int,
                score_cols: Optional[int] = None) -> TreeLevels:
    """z [K, H], u [K, V] (last dim contiguous), x_start [1] (long), pool ids [M] (long, on device;
    None: the whole vocabulary) -> TreeLevels of every frontier (module docstring), greedy. The same
    nodes as engine.domino_tree.grow_tree's levels up to fp32 summation order. `score_cols`: the pool
    columns a score program takes (None: SCORE_COLS; `score_split` widens it for wide frontiers)."""
    head = weights.head
    K, P, gru = z.shape[0], head.pure_draft_prefix_len, head.gru
    if pool_ids is None:  # the whole vocabulary (no pool, or no corrected slot: K <= P)
        pool_ids = torch.arange(base_logits.shape[1], device=z.device)
    assert base_logits.stride(-1) == 1 and pool_ids.dim() == 1 and pool_ids.is_contiguous()
    G, r, M, V = gru.w_hh.shape[1], head.w2.shape[1], pool_ids.numel(), base_logits.shape[1]
    device, dtype = z.device, weights.state_proj.dtype
    offers = offered(K, P, children, V, M)
    sizes = frontier_sizes(nodes, offers)
    S, widest = sum(sizes), max([1] + sizes[:-1])
    cols, n_split = score_split(M, widest, max(offers), score_cols)
    block_k = max(16, min(triton.next_power_of_2(r), 8192 // cols))  # [cols, block_k] W2 tiles: <= 8k elements
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
    pure = pure_partials(base_logits[:max(P, 1)], children)  # the pure slots' log_softmax partials

    frontier_tokens, frontier_parent = x_start.reshape(1), torch.full((1,), -1, dtype=torch.long, device=device)
    frontier_scores = torch.zeros(1, dtype=torch.float32, device=device)
    prev_state = prev_proj = torch.zeros(1, 1, dtype=dtype, device=device)  # unread: the root has no parent
    at, prev_at = 0, -1
    for j in range(K):
        F_j, C = frontier_tokens.shape[0], offers[j]
        state = torch.empty(F_j, G, dtype=dtype, device=device)
        _gates_kernel[(F_j, triton.cdiv(G, 128))](
            frontier_tokens, frontier_parent, prev_state, prev_proj, gru.table, state,
            G, prev_proj.stride(0), r, gru.table.stride(0), BLOCK_G=min(128, triton.next_power_of_2(G)))
        proj = torch.mm(state, weights.state_proj)  # [F, r + 3G]: W1_s · s, then W_hh · s
        if j >= P:
            _score_kernel[(triton.cdiv(F_j, SCORE_ROWS), n_split)](
                proj, proj.stride(0), z_proj[j], head.w2, head.w2.stride(0), base_logits[j], pool_ids, F_j, M, r,
                part_val, part_pos, part_max, part_sum, C=C, BLOCK_C=triton.next_power_of_2(C), BLOCK_F=SCORE_ROWS,
                COLS=cols, BLOCK_K=block_k, num_warps=4)
            parts, stride = (part_val, part_pos, part_max, part_sum, n_split), n_split
        else:  # every row's offers come from slot j's partials alone
            row = min(j, pure.n_slots - 1)
            parts, stride = pure.slot(row), 0
        n_keep = sizes[j]
        next_parent = torch.empty(n_keep, dtype=torch.long, device=device)  # index into this frontier
        _select_kernel[(1,)](
            *parts, stride, frontier_scores, pool_ids, M, F_j, n_keep, prev_at, j + 1, offer_val, offer_tok,
            tokens[at:], scores[at:], depth[at:], next_parent, parent[at:],
            PURE=j < P, C=C, BLOCK_C=block_c, BLOCK_F=triton.next_power_of_2(F_j),
            BLOCK_L=triton.next_power_of_2(parts[4] * C), BLOCK_S=triton.next_power_of_2(parts[4]),
            num_warps=8)
        prev_state, prev_proj, frontier_parent = state, proj, next_parent
        frontier_tokens, frontier_scores = tokens[at:at + n_keep], scores[at:at + n_keep]
        prev_at, at = at, at + n_keep
    return TreeLevels(tokens=tokens, scores=scores, depth=depth, parent=parent)
