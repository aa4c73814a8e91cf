"""Attention of a draft tree's T rows (T <= 320) over the KV cache, one launch, CUDA-graph capturable.

Cache layout k_cache, v_cache [Hkv, C, D]: rows 0 .. start-1 are the committed context, rows
start .. start+T-1 hold this forward's T tokens (already written by rope_cache), rows past that
are never read. `start` is a 0-d long tensor on the device, read by the kernel, so the grid and
the launch do not depend on it (a captured graph replays for any start) while the column loop
stops at start + T: the cost follows the context, not the capacity C.

Visibility is a bitmask of W int64 words per row, visible [T, W] (W >= cdiv(T, 64); a 1-D [T] is
one word a row): row i sees every context row (< start) and this forward's row j (cache row
start + j) iff bit j % 64 of word j // 64 of visible[i] is set (bit 63 of a word is its sign bit).
Row i must see itself (so no row is empty). Grouped-query heads: q head h reads kv head h // (Hq/Hkv).

    out[t, h] = softmax(q[t, h] · K[kv(h)]ᵀ · scale over the visible columns) · V[kv(h)]

Kernel: flash-attention with an online softmax in fp32 (exp2 domain). Program (kv head, tile, split)
stacks the G = Hq/Hkv query heads sharing that kv head for all T rows as its M dimension
(m = t·G + g, in tiles of BLOCK_M rows: 16 by default, 64 past 256 rows), so each K/V block is read
once per tile. head_dim is padded likewise to BLOCK_D >= 16 (masked loads: any D runs;
a power of two >= 16 needs no mask). Full context blocks run without masks; the last few blocks
(context tail + the tree: T / BLOCK_N + 2 at most) apply the bitmask, each gathering its rows'
words. q·Kᵀ runs on tl.dot from the storage dtype with fp32 accumulation (IEEE fp32 for fp32 inputs, no TF32); the probabilities are rounded to the storage
dtype for P·V, as HF's eager and SDPA attention do. Under TRITON_INTERPRET=1 the dot operands are
widened to fp32 first (same values: the interpreter's tl.dot multiplies bf16's raw bits otherwise).

Splits (flash-decoding inside the one launch): with Hkv·tiles programs alone a decode step runs
on 8 SMs (Qwen3-8B) and streams K/V at a small share of the bandwidth (journal). So the column range 0 .. start+T-1 is cut into
SPLITS runs of whole blocks, each at least MIN_SPAN blocks (the runs' length and number are
computed in the kernel from `start`: the grid stays fixed, a short context uses fewer runs and
one run writes out directly); each program leaves its unnormalised partial in a workspace and
takes a ticket from an atomic counter, and the last program of each (kv head, tile) merges the
partials, writes out and resets the counter. Nothing waits on another program (the interpreter, which runs programs one
after another, gets the same result).

Order: reference, helpers (bitmasks), kernel, launcher (+ workspace).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from dominospec.kernels.rms_norm import round_rtne

MAX_ROWS = 320  # rows of one forward: a verify of 1 + 256 tree nodes + a lookup chain fits (5 words a row)
WORD = 64  # bits of one int64 word of a row's mask

# ---- reference --------------------------------------------------------------------------------


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                             visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], caches [Hkv, C, D], start 0-d long, visible [T] or [T, W] int64 -> out [T, Hq, D] (q's dtype).

    Plain math over the [T, start + T] mask, in fp32 (fp64 for fp64 inputs); reads `start` on the host.
    """
    T, Hq, D = q.shape
    G = Hq // k_cache.shape[0]
    L = int(start) + T
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (as SDPA computes them)
    k = k_cache[:, :L].to(acc).repeat_interleave(G, dim=0)  # [Hq, L, D]
    v = v_cache[:, :L].to(acc).repeat_interleave(G, dim=0)
    context = torch.ones(T, L - T, dtype=torch.bool, device=q.device)
    mask = torch.cat([context, visible_from_bits(visible)], dim=1)  # [T, L]
    scores = torch.einsum("thd,hld->htl", q.to(acc), k) * scale
    p = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
    return torch.einsum("htl,hld->thd", p, v).to(q.dtype)


# ---- bitmask helpers (pure torch, no host reads: capturable) ----------------------------------


def bits_from_visible(visible: torch.Tensor, words: Optional[int] = None) -> torch.Tensor:
    """visible [T, T] bool (row i sees tree row j) -> [T, W] int64 (W = `words`, default cdiv(T, 64)):
    bit j % 64 of word j // 64 of row i set iff visible[i, j]."""
    T = visible.shape[0]
    W = -(-T // WORD) if words is None else words
    assert visible.shape == (T, T) and T <= MAX_ROWS and W * WORD >= T
    padded = torch.zeros(T, W * WORD, dtype=torch.long, device=visible.device)
    padded[:, :T] = visible.long()
    shifts = torch.arange(WORD, device=visible.device)
    return (padded.view(T, W, WORD) << shifts).sum(-1)  # disjoint bits: the sum is their OR (bit 63 wraps to the sign)


def visible_from_bits(visible: torch.Tensor) -> torch.Tensor:
    """visible [T] or [T, W] int64 bitmasks -> [T, T] bool (bit j % 64 of word j // 64 of row i)."""
    T = visible.shape[0]
    words = visible.reshape(T, -1)
    bits = (words[:, :, None] >> torch.arange(WORD, device=visible.device)) & 1  # [T, W, 64]
    return bits.reshape(T, -1)[:, :T].bool()


def causal_bits(T: int, device) -> torch.Tensor:
    """[T, cdiv(T, 64)] int64 bitmasks of a causal block: row i sees rows 0 .. i."""
    return bits_from_visible(torch.ones(T, T, dtype=torch.bool, device=device).tril())


# ---- kernel -----------------------------------------------------------------------------------


@triton.jit
def _attend_block(acc, m_i, l_i, q, vis_rows, mask_m, k_base, v_base, n0, start, end, stride_kc, stride_vc,
                  qk_scale, offs_d, mask_d, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PAD_D: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """One block of BLOCK_N cache rows n0 .. n0+BLOCK_N-1 folded into the online softmax.

    acc [BLOCK_M, D], m_i / l_i [BLOCK_M] fp32 (running max in the log2 domain, running sum).
    MASKED: columns >= end are not loaded, tree columns follow the row's bitmask: word j // 64 at
    `vis_rows` [BLOCK_M] (pointers to each row's first word; padded rows, mask_m false, see nothing).
    PAD_D: head_dim < BLOCK_D, the columns past it (mask_d false) are loaded as 0.
    DOT_FP32: K, V (and q, by the caller) go to tl.dot as fp32 (exact for bf16 values).
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[None, :] * stride_kc + offs_d[:, None]  # Kᵀ [D, BLOCK_N]
    v_ptrs = v_base + offs_n[:, None] * stride_vc + offs_d[None, :]  # V [BLOCK_N, D]
    if MASKED:
        valid = offs_n < end
        kT = tl.load(k_ptrs, mask=valid[None, :] & mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)
    elif PAD_D:
        kT = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
    else:
        kT = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    dtype = v.dtype  # storage dtype: P is rounded to it
    if DOT_FP32:
        kT = kT.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, kT, input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        j = offs_n - start  # tree column, where 0 <= j < T
        in_tree = (j >= 0) & valid
        col = tl.where(in_tree, j, 0)
        word = tl.load(vis_rows[:, None] + (col // 64)[None, :], mask=mask_m[:, None] & in_tree[None, :], other=0)
        bit = (word >> (col % 64)[None, :]) & 1
        seen = (j < 0)[None, :] | (in_tree[None, :] & (bit != 0))
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    else:
        m_new_safe = m_new
    alpha = tl.math.exp2(m_i - m_new_safe)
    p = tl.math.exp2(s - m_new_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(round_rtne(p, dtype).to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _store_out(o_ptrs, acc, l_i, mask_m, mask_d):
    """out = acc / l for the tile's real rows, rounded to out's dtype (padded rows: no 0/0, no store)."""
    out = acc / tl.where(mask_m, l_i, 1.0)[:, None]
    tl.store(o_ptrs, round_rtne(out, o_ptrs.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _combine_splits(part_ptr, stats_ptr, first_row, n_used, local, mask_m, offs_d, BLOCK_M: tl.constexpr,
                    D: tl.constexpr):
    """Merge the partial (acc, max, sum) of splits 0 .. n_used-1 (workspace rows first_row + s; tile
    rows `local` = 0 .. BLOCK_M-1, the real ones `mask_m`) -> (acc, sum) [BLOCK_M, D], [BLOCK_M]."""
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)  # D: the padded head_dim (BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(0, n_used):
        row = first_row + s
        m_s = tl.load(stats_ptr + (2 * row) * BLOCK_M + local, mask=mask_m, other=0.0, cache_modifier=".cg")
        l_s = tl.load(stats_ptr + (2 * row + 1) * BLOCK_M + local, mask=mask_m, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(part_ptr + row * BLOCK_M * D + local[:, None] * D + offs_d[None, :], mask=mask_m[:, None],
                        other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows (padding) that saw nothing yet
        alpha = tl.math.exp2(m_i - m_safe)
        beta = tl.math.exp2(m_s - m_safe)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        l_i = l_i * alpha + l_s * beta
        m_i = m_new
    return acc, l_i


@triton.jit
def _tree_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, vis_ptr, part_ptr, stats_ptr, count_ptr, T, G, qk_scale, stride_vt,
    stride_qt, stride_qh, stride_kh, stride_kc, stride_vh, stride_vc, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    MIN_SPAN: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Grid (Hkv, tiles = cdiv(G·T, BLOCK_M), SPLITS): program (kv head, tile, split) owns query rows
    m = t·G + g of its tile and the split-th run of whole column blocks of 0 .. start+T-1.

    A run is at least MIN_SPAN blocks, so a short context uses fewer runs (n_used <= SPLITS).
    SPLITS == 1 or n_used == 1: split 0 writes out. Else each program with a run leaves its
    unnormalised acc, max and sum in the workspace; every program takes a ticket, and the last of
    the tile's SPLITS merges the partials, writes out and sets the tile's counter back to 0.
    """
    kvh = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T * G
    t = offs_m // G
    h = kvh * G + offs_m % G  # q head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D  # BLOCK_D = max(16, next pow2 of D): tl.dot's smallest K
    q_ptrs = q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D], storage dtype
    if DOT_FP32:
        q = q.to(tl.float32)
    vis_rows = vis_ptr + t.to(tl.int64) * stride_vt  # [BLOCK_M]: each row's first mask word
    start = tl.load(start_ptr).to(tl.int64)
    end = start + T
    span = tl.maximum(tl.cdiv(end, SPLITS * BLOCK_N), MIN_SPAN) * BLOCK_N  # columns of one run, whole blocks
    lo = split * span
    hi = tl.minimum(lo + span, end)
    full_end = (start // BLOCK_N) * BLOCK_N  # blocks wholly inside the context: no mask
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, vis_rows, mask_m, k_base, v_base, n0, start, end, stride_kc,
                                      stride_vc, qk_scale, offs_d, mask_d, BLOCK_N, False, D != BLOCK_D, DOT_FP32)
    for n0 in range(tl.maximum(lo, full_end), hi, BLOCK_N):  # context tail + the tree: <= T / BLOCK_N + 2 blocks
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, vis_rows, mask_m, k_base, v_base, n0, start, end, stride_kc,
                                      stride_vc, qk_scale, offs_d, mask_d, BLOCK_N, True, D != BLOCK_D, DOT_FP32)
    o_ptrs = out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
    n_used = tl.cdiv(end, span)
    if SPLITS == 1:
        _store_out(o_ptrs, acc, l_i, mask_m, mask_d)
    else:
        pair = kvh * tl.num_programs(1) + tile  # (kv head, tile): its counter, its SPLITS workspace rows
        row = pair * SPLITS + split
        local = tl.arange(0, BLOCK_M)  # the tile's rows in the workspace
        if n_used == 1:
            if split == 0:
                _store_out(o_ptrs, acc, l_i, mask_m, mask_d)
        elif lo < hi:
            tl.store(part_ptr + row * BLOCK_M * BLOCK_D + local[:, None] * BLOCK_D + offs_d[None, :], acc,
                     mask=mask_m[:, None])
            tl.store(stats_ptr + (2 * row) * BLOCK_M + local, m_i, mask=mask_m)
            tl.store(stats_ptr + (2 * row + 1) * BLOCK_M + local, l_i, mask=mask_m)
        tl.debug_barrier()  # every thread's partial is stored before the ticket (release) is taken
        ticket = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the tile's last program: every partial is visible (acquire)
            if n_used > 1:
                acc, l_i = _combine_splits(part_ptr, stats_ptr, pair * SPLITS, n_used, local, mask_m, offs_d,
                                           BLOCK_M, BLOCK_D)
                _store_out(o_ptrs, acc, l_i, mask_m, mask_d)
            tl.store(count_ptr + pair, 0)


# ---- launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionWorkspace:
    """The launch of one (T, Hq, Hkv, D): its knobs, and the scratch of a split launch: partial acc
    [P, BLOCK_M, BLOCK_D] and stats [P, 2, BLOCK_M] (running max, sum) in fp32, P = Hkv · tiles ·
    splits; counters [Hkv · tiles] int32, zero between launches (each tile's last program resets its
    own), so one workspace serves every layer of a forward, launch after launch on one stream (not
    two launches at once). Knobs: splits, block_m (query rows a tile), block_n (cache rows a column
    block), min_span (the fewest blocks a split takes), num_warps."""

    splits: int
    block_m: int
    min_span: int
    partial: torch.Tensor
    stats: torch.Tensor
    counters: torch.Tensor
    block_n: int = 64
    num_warps: int = 4


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16


# The launch's defaults, from benchmarks/studies/attention_splits.py on one H100 (2026-12-06: every
# tile of 16/32/64/128 rows, column block of 16/32/64, 4 or 8 warps and two split counts, µs a layer,
# 36 layers in one graph). Qwen3-8B's heads (32 / 8 of 128) over 1,024 cached rows, the old defaults
# -> these: 1 row 9.8 -> 8.9, 16 rows 19.7 -> 11.3, 64 rows 26.9 -> 21.6, 256 rows 55.0 -> 43.1.
# SmolLM2's (9 / 3 of 64) over 512: 1 row 9.1 -> 6.8, 8 rows 12.5 -> 7.3, 16 rows 11.2 -> 7.2,
# 64 rows 14.8 -> 8.9, 256 rows 22.3 -> 20.5. Small tiles win while a forward has few query rows
# (G·T <= 256): more programs stream the cache; about one program per SM beats two.
SMALL_TILE_ROWS = 256  # G·T up to this: tiles of 16 rows, else 64
BLOCK_N = 32  # cache rows a column block: best or within 10 % of the best at every measured row count of both
# shapes; its [BLOCK_M, BLOCK_N] scores and [BLOCK_N, D] value tile keep a program's registers small at D = 128


def _block_m(T: int, num_heads: int, num_kv_heads: int) -> int:
    return 16 if T * num_heads // num_kv_heads <= SMALL_TILE_ROWS else 64


def default_splits(T: int, num_heads: int, num_kv_heads: int, device, block_m: Optional[int] = None) -> int:
    """Splits of the column range per (kv head, tile of block_m rows, default `_block_m`), so that the
    grid holds about one program per SM: ceil(SMs / tiles) with small tiles, floor with tiles of 64
    rows (at 256 rows of Qwen3-8B, 1 split took 43 µs, 2 took 53), at most 64; 1 under the
    interpreter or off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    block_m = _block_m(T, num_heads, num_kv_heads) if block_m is None else block_m
    tiles = num_kv_heads * triton.cdiv(T * num_heads // num_kv_heads, block_m)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(64, triton.cdiv(sms, tiles) if block_m <= 16 else sms // tiles))


def tree_attention_workspace(T: int, num_heads: int, num_kv_heads: int, head_dim: int, device,
                             splits: Optional[int] = None, min_span: int = 4, block_m: Optional[int] = None,
                             block_n: Optional[int] = None, num_warps: int = 4) -> AttentionWorkspace:
    """The workspace `tree_attention` uses for these shapes (allocated and zeroed here, once), with
    the launch's knobs.

    splits: runs of the column range per (kv head, tile) (default: `default_splits`); min_span:
    the fewest column blocks in a run, so that a short context merges few partials (or none);
    block_m: query rows a tile, a power of two >= 16 (default: G·T's, at most 64); block_n: cache
    rows a column block (default: BLOCK_N); num_warps: of a program.
    """
    block_m = _block_m(T, num_heads, num_kv_heads) if block_m is None else block_m
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if splits is None:
        splits = default_splits(T, num_heads, num_kv_heads, device, block_m)
    pairs = num_kv_heads * triton.cdiv(T * num_heads // num_kv_heads, block_m)
    rows = pairs * splits if splits > 1 else 0
    return AttentionWorkspace(
        splits=splits, block_m=block_m, min_span=min_span,
        partial=torch.empty(rows, block_m, _block_d(head_dim), dtype=torch.float32, device=device),
        stats=torch.empty(rows, 2, block_m, dtype=torch.float32, device=device),
        counters=torch.zeros(pairs, dtype=torch.int32, device=device),
        block_n=BLOCK_N if block_n is None else block_n, num_warps=num_warps,
    )


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                   visible: torch.Tensor, scale: float, workspace: Optional[AttentionWorkspace] = None) -> torch.Tensor:
    """q [T, Hq, D], caches [Hkv, C, D], start 0-d long (device), visible [T] or [T, W] int64 (device,
    W >= cdiv(T, 64)) -> out [T, Hq, D] in q's dtype (contiguous). One launch, fixed grid, no host sync.

    `workspace` (tree_attention_workspace) fixes the splits; without one a fresh one is made per
    call (a zero-fill before the launch: pass one to keep a captured graph at one node a call).
    The caller keeps start + T <= C; cache rows >= start + T are never read. The launch's knobs
    (tiles, column blocks, splits, warps) are the workspace's.
    """
    T, Hq, D = q.shape
    Hkv, C, Dk = k_cache.shape
    assert 1 <= T <= MAX_ROWS and Hq % Hkv == 0 and Dk == D and v_cache.shape == k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    words = visible.reshape(T, -1).contiguous()  # [T, W]
    assert visible.shape[0] == T and words.shape[1] * WORD >= T and visible.dtype == torch.int64 and start.numel() == 1
    ws = tree_attention_workspace(T, Hq, Hkv, D, q.device) if workspace is None else workspace
    G = Hq // Hkv
    tiles = triton.cdiv(G * T, ws.block_m)
    assert ws.counters.numel() == Hkv * tiles, "the workspace was made for another T or other heads"
    assert ws.splits == 1 or ws.partial.shape == (Hkv * tiles * ws.splits, ws.block_m, _block_d(D))
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    _tree_attention_fwd_kernel[(Hkv, tiles, ws.splits)](
        q, k_cache, v_cache, out, start, words, ws.partial, ws.stats, ws.counters,
        T, G, scale * math.log2(math.e), words.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        D=D, BLOCK_D=_block_d(D), BLOCK_M=ws.block_m, BLOCK_N=ws.block_n, SPLITS=ws.splits, MIN_SPAN=ws.min_span,
        DOT_FP32=os.environ.get("TRITON_INTERPRET") == "1", num_warps=ws.num_warps,
    )
    return out
