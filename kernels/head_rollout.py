"""The Domino head's rollout of one block, greedy or sampled: K sequential steps, two fused launches a step, on the device.

Inputs: z [K, H] (normed draft states of slots 0..K-1; slot j predicts d_{j+1}), base logits
u = lm_head(z) [K, V], the last committed token x_start [1]. Slots j < P (pure_draft_prefix_len)
take argmax u_j; slot j >= P takes
    d_{j+1} = argmax( u_j + W2 · SiLU(W1 · [z_j ; s_j]) )     s_j = GRU state after [x_start, d_1..d_j]
(the model's `rollout`, the one torch reference, step for step).

The kernel path. Before the loop, z_proj = z · W1_zᵀ for all K slots in one GEMM ([K, r]). Then
per step j, two launches (three without the GRU table):
- **score(j)**, grid (S + 3G / BLOCK_GH,): programs p < S compute h = z_proj[j] + Σ_c hpart[c] (the
  W1_s · s_j pieces the GRU step left), SiLU, and the corrected logits of C columns (V, or the M
  pool ids) in BLOCK_V tiles; program p takes tiles p, p + S, ... and keeps a running (max, first
  column of the max, Σ exp) in registers. The other programs compute gh = W_hh · s_j, which the
  next GRU step needs and which does not depend on the token this step picks, so the 3G x G
  GEMV runs beside the scoring instead of after it;
- **gru(j+1)**, grid (G / BLOCK_G,): every program reduces score(j)'s S partials to the token
  d_{j+1} (program 0 stores it, its logit and the logsumexp), gathers its slice of the input gates
  gi from the [V, 3G] table, runs the gates with gh, writes its slice of s_{j+1}, and its piece of
  W1_s · s_{j+1}: hpart[c] = W1_s[:, slice_c] · s_{j+1}[slice_c];
- without the table (it exceeds the memory budget), **input_gates(j+1)**, grid (3G / BLOCK_GH,),
  runs first: the same reduce, then gi = W_ih · E[token] into a [3G] buffer the GRU step reads.
The reduce is repeated in every program that needs the token and the h sum in every score
program, instead of atomics or an extra launch: each reads a few kB from L2, and the result is
deterministic, so a CUDA-graph replay gives the eager run's tokens. Nothing syncs with the host
and every shape is fixed by (K, pool size): one call can be captured whole in a CUDA graph.

Sampled (a temperature T, no top-k or top-p; uniforms U [K, V] drawn before the rollout): the score
step scales the logits to x / T, writes them, and keeps beside its running (max, Σ exp) the column
of the largest key x / T - log(-log U[column]) with its x / T; the reduce takes the largest key.
That is the exponential race of `engine.draft_head._Draws`: argmax q / E with E = -log U is
argmax log q - log E, and log q = x / T - lse. The launcher then forms q_j = exp(x / T - lse_j) over
the step's columns, scattered over the vocabulary (0 outside the pool): the distribution d_j was
drawn from, which lossless speculative sampling needs. Pure slots draw from u_j / T alike.

Ties go to the lowest column, as torch.argmax (in a pool: the lowest pool position, as torch's
`ids[argmax(scored)]`). Arithmetic is fp32 whatever the storage dtype; s_{j+1} is rounded to the
state's dtype before W1_s reads it, as the reference does.

The torch reference is the model's `rollout` (models/domino; tests/kernels compare against it).
Order: the result type, kernels, launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dominospec.kernels.gru_cell import GruWeights, gru_update, gru_weights

# ---- result -----------------------------------------------------------------------------------


@dataclass
class HeadChain:
    """tokens [K] long (d_1..d_K); confidence [K] fp32 (q_j(d_j), softmax of the scored logits) or None;
    probs [K, V] fp32 (sampled: each q_j over the vocabulary, 0 outside the pool) or None."""

    tokens: torch.Tensor
    confidence: Optional[torch.Tensor]
    probs: Optional[torch.Tensor] = None


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _reduce_partials(part_max_ptr, part_pos_ptr, part_sum_ptr, part_key_ptr, part_val_ptr, n_parts, ids_ptr,
                     POOL: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_S: tl.constexpr):
    """A score step's n_parts partials -> (token id int64, its (scaled) logit, logsumexp) of the whole
    row: greedy, the argmax; SAMPLE, the winner of the race (the largest key: module docstring).

    Ties: the lowest column among the programs holding the maximum (programs interleave tiles, so
    program order is not column order)."""
    offs = tl.arange(0, BLOCK_S)
    mask = offs < n_parts
    maxes = tl.load(part_max_ptr + offs, mask=mask, other=float("-inf"))
    best = tl.max(maxes, axis=0)
    pos = tl.load(part_pos_ptr + offs, mask=mask, other=0)
    sums = tl.load(part_sum_ptr + offs, mask=mask, other=0.0)
    lse = best + tl.log(tl.sum(tl.where(mask, sums * tl.exp(maxes - best), 0.0), axis=0))
    if SAMPLE:
        keys = tl.load(part_key_ptr + offs, mask=mask, other=float("-inf"))
        top = tl.max(keys, axis=0)
        first = tl.min(tl.where(mask & (keys == top), pos, 2 ** 31 - 1), axis=0)
        vals = tl.load(part_val_ptr + offs, mask=mask, other=float("-inf"))
        value = tl.max(tl.where(mask & (keys == top) & (pos == first), vals, float("-inf")), axis=0)
    else:
        first = tl.min(tl.where(mask & (maxes == best), pos, 2 ** 31 - 1), axis=0)
        value = best
    if POOL:
        token = tl.load(ids_ptr + first).to(tl.int64)
    else:
        token = first.to(tl.int64)
    return token, value, lse


@triton.jit
def _rows_gemv(w_ptr, stride_w, rows, mask_rows, x_ptr, n, BLOCK_K: tl.constexpr):
    """W[rows, :n] · x[:n] -> fp32 [len(rows)] (W kept in L2: these rows are read again every step)."""
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < n
        x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :],
                    mask=mask_rows[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_last")
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _score_step_kernel(
    zproj_ptr, hpart_ptr, n_hparts, w2_ptr, base_ptr, ids_ptr, part_max_ptr, part_pos_ptr, part_sum_ptr,
    part_key_ptr, part_val_ptr, noise_ptr, scaled_ptr, inv_temp,
    n_cols, r, stride_w2, n_tiles, n_score,
    state_ptr, w_hh_ptr, gh_ptr, G, stride_w_hh,
    CORRECT: tl.constexpr, POOL: tl.constexpr, GEMV: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_GH: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (n_score + GEMV programs,). Programs p < n_score score tiles p, p + n_score, ... of one row ->
    part_*[p] = (max, first column of the max, Σ exp(x - max)); CORRECT=False scores the base row alone
    (a pure draft slot). SAMPLE: the logits are scaled by 1/T first and written to scaled[column]; the
    column is the one of largest key x - log(-log U), U = noise[column], and part_key / part_val[p] hold
    its key and x. The others (GEMV) compute the next GRU step's gh = W_hh · s_j [3G], BLOCK_GH rows
    each: it needs s_j only, not the token this step picks, so it runs beside the scoring."""
    pid = tl.program_id(0)
    if pid < n_score:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < r
        lanes = tl.arange(0, BLOCK_V)
        if CORRECT:
            offs_p = tl.arange(0, BLOCK_P)
            pieces = tl.load(hpart_ptr + offs_p[:, None] * r + offs_r[None, :],
                             mask=(offs_p[:, None] < n_hparts) & mask_r[None, :], other=0.0)  # [BLOCK_P, BLOCK_R]
            h = tl.load(zproj_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32) + tl.sum(pieces, axis=0)
            mid = h * tl.sigmoid(h)  # SiLU [BLOCK_R]; masked lanes are 0
        run_max = float("-inf")
        run_pos = 0
        run_sum = 0.0
        run_key = float("-inf")
        run_val = float("-inf")
        for tile in range(pid, n_tiles, n_score):
            offs = tile * BLOCK_V + lanes
            mask = offs < n_cols
            if POOL:
                vocab = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int64)
            else:
                vocab = offs.to(tl.int64)
            logits = tl.load(base_ptr + vocab, mask=mask, other=0.0).to(tl.float32)
            if CORRECT:
                # a pool's rows are read again every step (keep them in L2); the full W2 streams through
                w = tl.load(w2_ptr + vocab[:, None] * stride_w2 + offs_r[None, :],
                            mask=mask[:, None] & mask_r[None, :], other=0.0,
                            eviction_policy="evict_last" if POOL else "evict_first").to(tl.float32)  # [BLOCK_V, BLOCK_R]
                logits += tl.sum(w * mid[None, :], axis=1)
            if SAMPLE:
                logits = logits * inv_temp
                tl.store(scaled_ptr + offs, logits, mask=mask)
            logits = tl.where(mask, logits, float("-inf"))
            tile_max = tl.max(logits, axis=0)
            new_max = tl.maximum(run_max, tile_max)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logits - new_max), axis=0)
            if SAMPLE:  # the exponential race: argmax q / E = argmax x - log E, E = -log U
                key = logits - tl.log(-tl.log(tl.load(noise_ptr + offs, mask=mask, other=0.5)))
                key = tl.where(mask, key, float("-inf"))
                tile_key = tl.max(key, axis=0)
                tile_first = tl.argmax(key, axis=0, tie_break_left=True)
                tile_val = tl.max(tl.where(lanes == tile_first, logits, float("-inf")), axis=0)
                run_val = tl.where(tile_key > run_key, tile_val, run_val)
                run_pos = tl.where(tile_key > run_key, tile * BLOCK_V + tile_first, run_pos)  # earlier tiles win ties
                run_key = tl.maximum(run_key, tile_key)
            else:
                tile_first = tl.argmax(logits, axis=0, tie_break_left=True)
                run_pos = tl.where(tile_max > run_max, tile * BLOCK_V + tile_first, run_pos)  # earlier tiles win ties
            run_max = new_max
        tl.store(part_max_ptr + pid, run_max)
        tl.store(part_pos_ptr + pid, run_pos.to(tl.int32))
        tl.store(part_sum_ptr + pid, run_sum)
        if SAMPLE:
            tl.store(part_key_ptr + pid, run_key)
            tl.store(part_val_ptr + pid, run_val)
    elif GEMV:
        rows = (pid - n_score) * BLOCK_GH + tl.arange(0, BLOCK_GH)
        mask_rows = rows < 3 * G
        tl.store(gh_ptr + rows, _rows_gemv(w_hh_ptr, stride_w_hh, rows, mask_rows, state_ptr, G, BLOCK_K), mask=mask_rows)


@triton.jit
def _input_gates_kernel(x_start_ptr, part_max_ptr, part_pos_ptr, part_sum_ptr, part_key_ptr, part_val_ptr, n_parts,
                        ids_ptr, embed_ptr, w_ih_ptr, gi_ptr, G, H, stride_embed, stride_w_ih,
                        REDUCE: tl.constexpr, POOL: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_GH: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(3G, BLOCK_GH),), only without the [V, 3G] table: the token (REDUCE: from the score
    step's partials, else x_start), then gi[rows] = W_ih[rows] · E[token] for BLOCK_GH of the 3G rows."""
    if REDUCE:
        token, best, lse = _reduce_partials(part_max_ptr, part_pos_ptr, part_sum_ptr, part_key_ptr, part_val_ptr,
                                            n_parts, ids_ptr, POOL, SAMPLE, BLOCK_S)
    else:
        token = tl.load(x_start_ptr).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_GH + tl.arange(0, BLOCK_GH)
    mask_rows = rows < 3 * G
    gi = _rows_gemv(w_ih_ptr, stride_w_ih, rows, mask_rows, embed_ptr + token * stride_embed, H, BLOCK_K)
    tl.store(gi_ptr + rows, gi, mask=mask_rows)


@triton.jit
def _gru_step_kernel(
    tokens_ptr, best_ptr, lse_ptr, step, part_max_ptr, part_pos_ptr, part_sum_ptr, part_key_ptr, part_val_ptr,
    n_parts, ids_ptr, table_ptr, state_ptr, gh_ptr, out_ptr, w1s_t_ptr, hpart_ptr, G, r, stride_table,
    REDUCE: tl.constexpr, POOL: tl.constexpr, SAMPLE: tl.constexpr, RUN_GRU: tl.constexpr, FIRST: tl.constexpr,
    USE_TABLE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid (cdiv(G, BLOCK_G),): the token tokens[step] (REDUCE: from the previous score step's partials,
    stored with its logit and logsumexp at step - 1), then (RUN_GRU) the GRU slice of program c:
    out[slice_c] = s' from the state, gh = W_hh · state (FIRST: the zero state, gh = 0) and the
    token's input gates; and hpart[c] = W1_s[:, slice_c] · s'[slice_c]."""
    pid = tl.program_id(0)
    offs_g = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    offs_r = tl.arange(0, BLOCK_R)
    if RUN_GRU:  # what does not depend on the token is loaded first, so its latency hides behind the reduce
        w1 = tl.load(w1s_t_ptr + offs_g[:, None] * r + offs_r[None, :],
                     mask=mask_g[:, None] & (offs_r[None, :] < r), other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_R]
        if FIRST:
            gh_r = tl.zeros([BLOCK_G], dtype=tl.float32)
            gh_z = gh_r
            gh_n = gh_r
            s = gh_r
        else:
            gh_r = tl.load(gh_ptr + offs_g, mask=mask_g, other=0.0)
            gh_z = tl.load(gh_ptr + G + offs_g, mask=mask_g, other=0.0)
            gh_n = tl.load(gh_ptr + 2 * G + offs_g, mask=mask_g, other=0.0)
            s = tl.load(state_ptr + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    if REDUCE:
        token, best, lse = _reduce_partials(part_max_ptr, part_pos_ptr, part_sum_ptr, part_key_ptr, part_val_ptr,
                                            n_parts, ids_ptr, POOL, SAMPLE, BLOCK_S)
        first = pid == 0
        tl.store(tokens_ptr + step, token, mask=first)
        tl.store(best_ptr + step - 1, best, mask=first)
        tl.store(lse_ptr + step - 1, lse, mask=first)
    else:
        token = tl.load(tokens_ptr + step).to(tl.int64)
    if RUN_GRU:
        if USE_TABLE:
            gi_row = table_ptr + token * stride_table
            gi_r = tl.load(gi_row + offs_g, mask=mask_g, other=0.0).to(tl.float32)
            gi_z = tl.load(gi_row + G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
            gi_n = tl.load(gi_row + 2 * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
        else:  # gi = W_ih · E[token], computed by _input_gates_kernel into table_ptr [3G] fp32
            gi_r = tl.load(table_ptr + offs_g, mask=mask_g, other=0.0)
            gi_z = tl.load(table_ptr + G + offs_g, mask=mask_g, other=0.0)
            gi_n = tl.load(table_ptr + 2 * G + offs_g, mask=mask_g, other=0.0)
        s_next = gru_update(gi_r, gi_z, gi_n, gh_r, gh_z, gh_n, s).to(out_ptr.dtype.element_ty)  # rounded as stored
        tl.store(out_ptr + offs_g, s_next, mask=mask_g)
        piece = tl.sum(w1 * s_next.to(tl.float32)[:, None], axis=0)  # masked rows: s' = 0
        tl.store(hpart_ptr + pid * r + offs_r, piece, mask=offs_r < r)


# ---- launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadWeights:
    """The head prepared once for the kernels: GRU (table or GEMV), W1 split at H, W2."""

    gru: GruWeights
    w1_z: torch.Tensor  # [r, H]: W1[:, :H], applied to z
    w1_s_t: torch.Tensor  # [G, r]: W1[:, H:]ᵀ, applied to the GRU state (rows = state elements: a slice is contiguous)
    w2: torch.Tensor  # [V, r]
    pure_draft_prefix_len: int


def head_weights(embed: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 pure_draft_prefix_len: int, table_budget_bytes: int) -> HeadWeights:
    """E [V, H], W_ih [3G, H], W_hh [3G, G], W1 [r, H+G], W2 [V, r] -> HeadWeights (see `gru_weights` for the budget)."""
    H = w_ih.shape[1]
    w1 = w1.detach()
    return HeadWeights(gru=gru_weights(embed, w_ih, w_hh, table_budget_bytes), w1_z=w1[:, :H].contiguous(),
                       w1_s_t=w1[:, H:].t().contiguous(), w2=w2.detach().contiguous(),
                       pure_draft_prefix_len=int(pure_draft_prefix_len))


@dataclass(frozen=True)
class RolloutPlan:
    """Launch shapes of one rollout: score tiles of BLOCK_V columns spread over `score_programs`
    programs; GRU slices of BLOCK_G state elements (G / BLOCK_G programs, as many W1_s · s pieces)."""

    block_v: int
    score_programs: int
    block_g: int
    score_warps: int
    block_gh: int  # W_hh rows per GEMV program (3G / block_gh programs beside the scoring ones)
    gru_warps: int


def rollout_plan(n_cols: int, r: int, G: int, block_v: Optional[int] = None, score_programs: Optional[int] = None,
                 block_g: Optional[int] = None, score_warps: Optional[int] = None,
                 block_gh: Optional[int] = None, gru_warps: Optional[int] = None) -> RolloutPlan:
    """Defaults from an H200 sweep at Qwen3-8B shapes (bf16, r = 256, G = 1024, K = 15, inside a CUDA
    graph; `benchmarks/head_kernels_gpu.py --sweep`): the full vocabulary in [32, r] tiles over 1,056
    programs (about 8 per SM, 4.5 tiles each); a pool in tiles of 16, one program per tile, 2 warps;
    GRU slices of 128 state elements; 8 W_hh rows per GEMV program. A tile
    holds at most 16k fp32 W2 elements, so a wide rank gets fewer columns."""
    pool = n_cols <= 16384
    block_r = triton.next_power_of_2(r)
    block_v = block_v or (16 if pool else 32)
    block_v = max(1, min(block_v, 16384 // block_r, triton.next_power_of_2(n_cols)))
    n_tiles = triton.cdiv(n_cols, block_v)
    score_programs = max(1, min(score_programs or (n_tiles if pool else 1056), n_tiles))  # each owns >= 1 tile
    block_g = min(block_g or 128, triton.next_power_of_2(G))
    block_gh = min(block_gh or 8, triton.next_power_of_2(3 * G))
    return RolloutPlan(block_v, score_programs, block_g, score_warps or (2 if pool else 4), block_gh, gru_warps or 4)


def head_rollout(weights: HeadWeights, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
                 pool_ids: Optional[torch.Tensor] = None, confidence: bool = False,
                 block_v: Optional[int] = None, score_programs: Optional[int] = None,
                 block_g: Optional[int] = None, score_warps: Optional[int] = None,
                 block_gh: Optional[int] = None, gru_warps: Optional[int] = None,
                 noise: Optional[torch.Tensor] = None, temperature: float = 1.0) -> HeadChain:
    """z [K, H], u [K, V] (last dim contiguous), x_start [1] (long, on device), pool ids [M] or None
    -> HeadChain. Greedy: the same tokens as the model's greedy `rollout` up to fp32 summation order.
    Sampled (`noise` [K, V] fp32 uniforms, last dim contiguous; T = `temperature` > 0, no top-k or
    top-p): step j draws from q_j = softmax(scored_j / T) by the race on noise[j]'s first N columns
    (N = M pooled, else V), as `engine.draft_head._Draws` does, and the chain carries q_j (probs) and
    q_j(d_j) (confidence).
    block_v, score_programs, block_g, score_warps, block_gh, gru_warps: override `rollout_plan`'s defaults."""
    K = z.shape[0]
    gru = weights.gru
    G, r = gru.w_hh.shape[1], weights.w2.shape[1]
    V = weights.w2.shape[0]
    P = weights.pure_draft_prefix_len
    device = z.device
    assert base_logits.shape == (K, V) and base_logits.stride(-1) == 1, (tuple(base_logits.shape), V)
    pool = pool_ids is not None
    if pool:
        assert pool_ids.dim() == 1 and pool_ids.is_contiguous()
    n_cols = pool_ids.numel() if pool else V
    plan = rollout_plan(n_cols, r, G, block_v, score_programs, block_g, score_warps, block_gh, gru_warps)
    full = rollout_plan(V, r, G, None, None, block_g, None, block_gh)  # pure draft slots score the whole base row
    n_gru = triton.cdiv(G, plan.block_g)
    block_r = triton.next_power_of_2(r)
    block_s = triton.next_power_of_2(max(plan.score_programs, full.score_programs))
    block_k = min(1024, triton.next_power_of_2(max(G, z.shape[1])))
    n_gemv = triton.cdiv(3 * G, plan.block_gh)
    table = gru.table
    use_table = table is not None

    tokens = torch.empty(K + 1, dtype=torch.long, device=device)  # [x_start (unused: read from x_start), d_1..d_K]
    states = torch.empty(K + 1, G, dtype=gru.w_hh.dtype, device=device)  # states[i + 1] consumed tokens[0..i]
    hpart = torch.empty(n_gru, r, dtype=torch.float32, device=device)  # W1_s · s pieces for the next score
    gh = torch.empty(3 * G, dtype=torch.float32, device=device)  # W_hh · s for the next GRU step
    part_max = torch.empty(block_s, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_pos = torch.empty(block_s, dtype=torch.int32, device=device)
    sample = noise is not None
    if sample:
        assert noise.shape == (K, V) and noise.stride(-1) == 1 and temperature > 0, (tuple(noise.shape), temperature)
    part_key, part_val = torch.empty_like(part_max), torch.empty_like(part_max)  # the race's partials (sampled)
    scaled = torch.empty(K, V, dtype=torch.float32, device=device) if sample else part_max  # step j's x / T
    noise_rows = noise if sample else scaled
    best = torch.empty(K, dtype=torch.float32, device=device)
    lse = torch.empty_like(best)
    z_proj = F.linear(z.to(weights.w1_z.dtype), weights.w1_z)  # [K, r], all slots in one GEMM
    ids = pool_ids if pool else part_pos  # a placeholder pointer when there is no pool

    gi = None if use_table else torch.empty(3 * G, dtype=torch.float32, device=device)  # W_ih · E[token]

    def gru_step(step: int, reduce: bool, pooled: bool, n_parts: int, run_gru: bool) -> None:
        if run_gru and not use_table:
            _input_gates_kernel[(n_gemv,)](
                x_start, part_max, part_pos, part_sum, part_key, part_val, n_parts, ids, gru.embed, gru.w_ih, gi, G,
                gru.embed.shape[1], gru.embed.stride(0), gru.w_ih.stride(0), REDUCE=reduce, POOL=pooled,
                SAMPLE=sample, BLOCK_S=block_s, BLOCK_GH=plan.block_gh, BLOCK_K=block_k,
            )
        _gru_step_kernel[(n_gru if run_gru else 1,)](
            x_start if step == 0 else tokens, best, lse, step, part_max, part_pos, part_sum, part_key, part_val,
            n_parts, ids, table if use_table else gi, states[step], gh, states[step + 1 if run_gru else step],
            weights.w1_s_t, hpart, G, r, table.stride(0) if use_table else 0,
            REDUCE=reduce, POOL=pooled, SAMPLE=sample, RUN_GRU=run_gru, FIRST=step == 0, USE_TABLE=use_table,
            BLOCK_S=block_s, BLOCK_G=plan.block_g, BLOCK_R=block_r, num_warps=plan.gru_warps,
        )

    gru_step(0, reduce=False, pooled=False, n_parts=0, run_gru=True)  # s_0 from x_start, and W1_s · s_0
    for j in range(K):
        corrected = j >= P
        step_plan = plan if corrected else full
        pooled = pool and corrected
        n_tiles = triton.cdiv(n_cols if corrected else V, step_plan.block_v)
        gemv = j + 1 < K  # gh = W_hh · s_j for GRU step j + 1
        _score_step_kernel[(step_plan.score_programs + (n_gemv if gemv else 0),)](
            z_proj[j], hpart, n_gru, weights.w2, base_logits[j], ids, part_max, part_pos, part_sum,
            part_key, part_val, noise_rows[j], scaled[j] if sample else scaled, 1.0 / temperature if sample else 1.0,
            n_cols if corrected else V, r, weights.w2.stride(0), n_tiles, step_plan.score_programs,
            states[j + 1], gru.w_hh, gh, G, gru.w_hh.stride(0),
            CORRECT=corrected, POOL=pooled, GEMV=gemv, SAMPLE=sample, BLOCK_V=step_plan.block_v, BLOCK_R=block_r,
            BLOCK_P=triton.next_power_of_2(n_gru), BLOCK_GH=plan.block_gh, BLOCK_K=block_k,
            num_warps=step_plan.score_warps,
        )
        gru_step(j + 1, reduce=True, pooled=pooled, n_parts=step_plan.score_programs, run_gru=j + 1 < K)
    if not sample:
        return HeadChain(tokens[1:], torch.exp(best - lse) if confidence else None)
    q = torch.exp(scaled - lse[:, None])  # [K, V]: row j's first N columns are q_j (N = M on a pooled step)
    probs = torch.zeros(K, V, dtype=torch.float32, device=device)
    pure = min(P, K)
    probs[:pure] = q[:pure]
    if K > pure:
        if pool:
            probs[pure:].index_copy_(1, pool_ids, q[pure:, :n_cols])
        else:
            probs[pure:] = q[pure:]
    return HeadChain(tokens[1:], torch.exp(best - lse), probs)
