"""The Domino rollout's candidate pool, selected on the device in four launches (bf16 / fp16; fp32: six): ids ascending.

    best[v] = max_{first <= j < K} u[j, v]            u: base logits [K, V]
    pool    = the M columns of largest best, ties at the boundary to the lowest ids, sorted ascending

The pool is the same SET as `engine.draft_head.candidate_pool` (max over rows, then `torch.topk`)
wherever the M-th largest value is not tied; torch.topk leaves a tie at the boundary unspecified
(observed on CPU, torch 2.13: not the lowest ids), the rule here is fixed. The ids come sorted, so
a pool position's order is the vocabulary's (the rollout's argmax ties then go to the lowest id).

The kernel path is a radix select over an order-preserving integer key of best, one 8-bit digit a
launch, with no program scanning more than a few 256-bin histograms:
- **key**, grid (cdiv(V, BLOCK),): each program takes BLOCK columns, the max over rows first..K-1
  (one [BLOCK_K, BLOCK] load), its key (16 bits for bf16 / fp16, 32 for fp32; signed int32 whose
  order is the float order; ±0 one key, every NaN the largest, as torch.sort puts them), stores
  keys [V] and adds the top digit's 256-bin histogram of its columns to hist[0] (atomics);
- **digit L** (L = 1 .. LEVELS - 1: one launch for 16-bit keys, three for 32), same grid: every
  program walks hist[0..L-1] from the top (a 256-element cumsum each) to the threshold's first
  L digits and the count still needed, and adds the digit L histogram of its matching columns to
  hist[L];
- **count**, same grid: every program walks all LEVELS histograms to the threshold key t and
  need = M - #(key > t) (1 <= need <= #(key == t)), and writes its own n_gt = #(key > t) and
  n_eq = #(key == t) to counts [2, n_prog]; program 0 stores (t, need);
- **write**, same grid: every program sums the counts of the programs before it (a few hundred
  ints) and writes its selected columns (key > t, or key == t within the first `need` of the
  tied columns in id order) at their rank: programs own consecutive column ranges, so the output
  is sorted ascending with no sort. Program 0 zeroes hist for the next call.
Nothing waits on another program of its own launch (Triton's CPU interpreter runs programs one
after another), nothing syncs with the host, and every buffer lives in a `PoolWorkspace` made
once: the whole selection can be captured in a CUDA graph. Invariant: `hist` is all zeros
between calls (made with zeros; the write launch zeroes it after its last reader).

Order: reference (plain torch), kernels, launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

KEY_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}  # the dtypes the kernels select over
DIGIT_BINS = 256  # one 8-bit digit a launch
_BINS = tl.constexpr(DIGIT_BINS)
DEFAULT_BLOCK = 1024  # columns a program (V = 151,936: 149 programs); not tuned on a GPU yet

# ---- reference --------------------------------------------------------------------------------


def pool_select_reference(base_logits: torch.Tensor, first: int, pool_size: int) -> Optional[torch.Tensor]:
    """u [K, V] -> ids [M] long, ascending: the M largest of max over rows first..K-1, ties to the
    lowest ids (None: the full vocabulary, when M <= 0, M >= V or first >= K, as candidate_pool)."""
    K, V = base_logits.shape
    if pool_size <= 0 or pool_size >= V or first >= K:
        return None
    best = base_logits[first:].amax(dim=0)  # [V], exact in any dtype; NaN propagates
    order = torch.sort(best, descending=True, stable=True).indices  # equal values keep id order; NaN first
    return torch.sort(order[:pool_size]).values


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _descend(hist_ptr, pool_size, LEVELS_DONE: tl.constexpr):
    """hist[0..LEVELS_DONE-1] ([LEVELS, 256] int32) -> (prefix, need): the threshold key's top
    8·LEVELS_DONE bits as the signed value `key >> (KEY_BITS - 8·LEVELS_DONE)`, and how many columns
    with that prefix the pool still takes (1 <= need <= their count)."""
    lanes = tl.arange(0, _BINS)
    need = pool_size
    prefix = 0
    for level in tl.static_range(LEVELS_DONE):
        count = tl.load(hist_ptr + level * _BINS + (_BINS - 1) - lanes)  # count[i]: columns of digit 255 - i
        at_least = tl.cumsum(count, axis=0)  # columns of digit >= 255 - i, nondecreasing
        short = at_least < need  # true exactly for the digits above the boundary
        digit = (_BINS - 1) - tl.sum(short.to(tl.int32), axis=0)
        need = need - tl.sum(tl.where(short, count, 0), axis=0)
        if level == 0:
            prefix = digit - _BINS // 2  # the top digit is biased: signed top byte = digit - 128
        else:
            prefix = prefix * _BINS + digit
    return prefix, need


@triton.jit
def _pool_keys_kernel(u_ptr, stride_u, first, K, V, keys_ptr, hist_ptr,
                      KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(V, BLOCK),): keys[cols] = order key of max_{first <= j < K} u[j, cols]; hist[0] += the
    256-bin histogram of the keys' top digit (biased: 0 = most negative)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    rows = first + tl.arange(0, BLOCK_K)
    x = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=(rows < K)[:, None] & in_vocab[None, :],
                other=float("-inf")).to(tl.float32)  # [BLOCK_K, BLOCK], exact
    is_nan = tl.max((x != x).to(tl.int32), axis=0) > 0  # [BLOCK]: tl.max drops NaN, torch.amax keeps it
    best32 = tl.max(x, axis=0)
    best = best32.to(u_ptr.dtype.element_ty)  # exact: a max of values of that dtype
    if KEY_BITS == 16:
        bits = best.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
    else:
        bits = best.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> (KEY_BITS - 1)) & ((1 << (KEY_BITS - 1)) - 1))  # negatives: flip the magnitude
    key = tl.where(best32 == 0, 0, key)  # -0 and +0: one value (compared in fp32: the interpreter's bf16 compares bits)
    key = tl.where(is_nan, (1 << (KEY_BITS - 1)) - 1, key)  # NaN above +inf, as torch.sort
    tl.store(keys_ptr + cols, key, mask=in_vocab)
    digit = ((key >> (KEY_BITS - 8)) & (_BINS - 1)) ^ (_BINS // 2)
    count = tl.histogram(digit, _BINS, mask=in_vocab)
    tl.atomic_add(hist_ptr + tl.arange(0, _BINS), count, mask=count > 0, sem="relaxed")  # read by the next launch


@triton.jit
def _pool_digit_kernel(keys_ptr, V, hist_ptr, pool_size,
                       LEVEL: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(V, BLOCK),): hist[LEVEL] += the histogram of digit LEVEL over this program's columns
    whose higher digits are the threshold's (found from hist[0..LEVEL-1])."""
    prefix, need = _descend(hist_ptr, pool_size, LEVEL)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    key = tl.load(keys_ptr + cols, mask=in_vocab, other=0)
    match = in_vocab & ((key >> (KEY_BITS - 8 * LEVEL)) == prefix)
    digit = (key >> (KEY_BITS - 8 * (LEVEL + 1))) & (_BINS - 1)
    count = tl.histogram(digit, _BINS, mask=match)
    tl.atomic_add(hist_ptr + LEVEL * _BINS + tl.arange(0, _BINS), count, mask=count > 0, sem="relaxed")


@triton.jit
def _pool_count_kernel(keys_ptr, V, hist_ptr, pool_size, counts_ptr, n_prog, threshold_ptr,
                       LEVELS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (n_prog,): counts[0, p] = #(key > t), counts[1, p] = #(key == t) over program p's columns;
    threshold = (t, need), stored by program 0."""
    t, need = _descend(hist_ptr, pool_size, LEVELS)
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    key = tl.load(keys_ptr + cols, mask=in_vocab, other=0)
    tl.store(counts_ptr + pid, tl.sum((in_vocab & (key > t)).to(tl.int32), axis=0))
    tl.store(counts_ptr + n_prog + pid, tl.sum((in_vocab & (key == t)).to(tl.int32), axis=0))
    if pid == 0:
        tl.store(threshold_ptr, t)
        tl.store(threshold_ptr + 1, need)


@triton.jit
def _pool_write_kernel(keys_ptr, V, counts_ptr, n_prog, threshold_ptr, hist_ptr, ids_ptr,
                       LEVELS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """Grid (n_prog,): ids[rank] = column for each selected column of program p (rank: selected
    columns before it); program 0 zeroes hist [LEVELS, 256]."""
    pid = tl.program_id(0)
    t = tl.load(threshold_ptr)
    need = tl.load(threshold_ptr + 1)
    before = tl.arange(0, BLOCK_P) < pid
    gt_before = tl.sum(tl.load(counts_ptr + tl.arange(0, BLOCK_P), mask=before, other=0), axis=0)
    eq_before = tl.sum(tl.load(counts_ptr + n_prog + tl.arange(0, BLOCK_P), mask=before, other=0), axis=0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < V
    key = tl.load(keys_ptr + cols, mask=in_vocab, other=0)
    tied = (in_vocab & (key == t)).to(tl.int32)
    tie_rank = eq_before + tl.cumsum(tied, axis=0) - tied  # among all tied columns, in id order
    take = ((in_vocab & (key > t)) | ((tied > 0) & (tie_rank < need))).to(tl.int32)
    rank = gt_before + tl.minimum(eq_before, need) + tl.cumsum(take, axis=0) - take
    tl.store(ids_ptr + rank, cols.to(tl.int64), mask=take > 0)
    if pid == 0:
        tl.store(hist_ptr + tl.arange(0, LEVELS * _BINS), tl.zeros([LEVELS * _BINS], dtype=tl.int32))


# ---- launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolWorkspace:
    """Buffers of one (V, M, dtype) selection, reused by every call (CUDA-graph capturable)."""

    keys: torch.Tensor  # [V] int32: order keys of the max over rows
    hist: torch.Tensor  # [LEVELS, 256] int32: one digit's histogram a level; all zeros between calls
    counts: torch.Tensor  # [2, n_prog] int32: n_gt, n_eq of each program
    threshold: torch.Tensor  # [2] int32: the threshold key t, and how many tied columns are taken
    ids: torch.Tensor  # [M] int64: the output, ascending
    key_bits: int
    block: int


def pool_workspace(vocab: int, pool_size: int, dtype: torch.dtype, device: torch.device,
                   block: int = DEFAULT_BLOCK) -> PoolWorkspace:
    """(V, M, the logits' dtype) -> zeroed buffers for `pool_select`; BLOCK columns a program (a power of 2)."""
    if dtype not in KEY_BITS:
        raise ValueError(f"pool_select supports {', '.join(str(d) for d in KEY_BITS)} base logits, not {dtype}")
    if block & (block - 1) or block < 16:
        raise ValueError(f"block must be a power of 2 >= 16, got {block}")
    n_prog = triton.cdiv(vocab, block)
    levels = KEY_BITS[dtype] // 8

    def zeros(*shape, dtype=torch.int32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return PoolWorkspace(keys=zeros(vocab), hist=zeros(levels, DIGIT_BINS), counts=zeros(2, n_prog), threshold=zeros(2),
                         ids=zeros(pool_size, dtype=torch.long), key_bits=KEY_BITS[dtype], block=block)


def pool_select(base_logits: torch.Tensor, first: int, pool_size: int,
                workspace: Optional[PoolWorkspace] = None) -> Optional[torch.Tensor]:
    """u [K, V] (last dim contiguous; bf16, fp16 or fp32) -> ids [M] long, ascending: the same as
    `pool_select_reference` (None where it is None). Returns `workspace.ids` (one is made when none is
    given), which the next call on that workspace overwrites. 2 + LEVELS launches, no host sync."""
    K, V = base_logits.shape
    if pool_size <= 0 or pool_size >= V or first >= K:
        return None
    ws = workspace or pool_workspace(V, pool_size, base_logits.dtype, base_logits.device)
    if KEY_BITS.get(base_logits.dtype) != ws.key_bits or ws.keys.numel() != V or ws.ids.numel() != pool_size:
        raise ValueError(f"workspace for V={ws.keys.numel()}, M={ws.ids.numel()}, {ws.key_bits}-bit keys; "
                         f"called with V={V}, M={pool_size}, {base_logits.dtype}")
    assert base_logits.stride(-1) == 1, base_logits.stride()
    levels, n_prog = ws.key_bits // 8, ws.counts.shape[1]
    grid = (n_prog,)
    _pool_keys_kernel[grid](base_logits, base_logits.stride(0), first, K, V, ws.keys, ws.hist,
                            KEY_BITS=ws.key_bits, BLOCK=ws.block, BLOCK_K=triton.next_power_of_2(K - first),
                            num_warps=8)
    for level in range(1, levels):
        _pool_digit_kernel[grid](ws.keys, V, ws.hist, pool_size, LEVEL=level, KEY_BITS=ws.key_bits, BLOCK=ws.block,
                                 num_warps=4)
    _pool_count_kernel[grid](ws.keys, V, ws.hist, pool_size, ws.counts, n_prog, ws.threshold,
                             LEVELS=levels, BLOCK=ws.block, num_warps=4)
    _pool_write_kernel[grid](ws.keys, V, ws.counts, n_prog, ws.threshold, ws.hist, ws.ids,
                             LEVELS=levels, BLOCK=ws.block, BLOCK_P=triton.next_power_of_2(n_prog), num_warps=4)
    return ws.ids
