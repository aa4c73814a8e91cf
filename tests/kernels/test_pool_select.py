"""kernels.pool_select against its reference: the candidate pool's ids, exactly (no tolerance).

- the ids equal `pool_select_reference`'s (sorted ascending) over odd shapes (V not a multiple of the
  block, K = 2..16, first 0 or 1, M = 1 .. V - 1) in bf16, fp16 and fp32; and where the M-th value
  is not tied, the same set as `candidate_pool` (the torch path's max + torch.topk);
- ties at the boundary go to the lowest ids (checked against the rule itself, not only the reference);
- -inf, ±inf, the largest finite values, ±0 and NaN order as torch.sort orders them;
- M <= 0, M >= V and first >= K give None, as the reference; a reused workspace stays right (its
  histograms are zeroed by the last launch); other dtypes are refused with a clear error.
Run: python -m pytest tests/kernels/test_pool_select.py -q
"""

import pytest
import torch
from kernel_helpers import DEVICE

from dominospec.engine.draft_head import candidate_pool
from dominospec.kernels.pool_select import pool_select, pool_select_reference, pool_workspace

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # K, V, block (columns a program), first
    (15, 3001, 1024, 1),  # the engine's K and block, V not a multiple of it
    (2, 5003, 256, 1),  # one corrected row, 20 programs
    (16, 4099, 512, 0),  # every row, a last program of 3 columns
    (7, 2000, 2048, 1),  # one program, fewer columns than the block
]


def logits(K, V, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(K, V, generator=g) * scale).to(DEVICE, dtype)


def select(u, first, M, block):
    K, V = u.shape
    return pool_select(u, first, M, pool_workspace(V, M, u.dtype, u.device, block=block))


def boundary_tied(u, first, M) -> bool:
    """Is the M-th largest of the max over rows equal to the (M+1)-th (so that torch.topk's set is not unique)?"""
    values = torch.sort(u[first:].amax(0).float(), descending=True).values
    return bool(values[M - 1] == values[M])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, V, block, first", SHAPES)
def test_matches_reference(K, V, block, first, dtype):
    u = logits(K, V, dtype, seed=K)
    for M in (1, 2, 37, V // 2, V - 1):
        got, ref = select(u, first, M, block), pool_select_reference(u, first, M)
        assert got.dtype == torch.long and got.shape == (M,)
        assert torch.equal(got.cpu(), ref.cpu()), (M, (got != ref).nonzero()[:5].flatten().tolist())
        assert bool((got[1:] > got[:-1]).all()), "ids must be strictly ascending"
        if not boundary_tied(u, first, M):  # the set is unique: the torch path's pool is the same set
            assert set(got.tolist()) == set(candidate_pool(u, first, M).tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_at_the_boundary_go_to_the_lowest_ids(dtype):
    """Few distinct values: the M-th value has hundreds of ties, a few of which the pool takes."""
    K, V, first = 5, 6007, 1
    g = torch.Generator().manual_seed(3)
    u = torch.randint(-3, 4, (K, V), generator=g).to(DEVICE, dtype)
    best = u[first:].amax(0).float()
    for M in (1, 500, 3000, 5000, V - 1):
        got = select(u, first, M, 512)
        ref = pool_select_reference(u, first, M)
        assert torch.equal(got.cpu(), ref.cpu()), M
        t = torch.sort(best, descending=True).values[M - 1]
        above, tied = (best > t).nonzero().flatten(), (best == t).nonzero().flatten()
        need = M - above.numel()
        assert 0 < need < tied.numel(), "the test must exercise a partial tie"
        rule = torch.sort(torch.cat([above, tied[:need]])).values
        assert torch.equal(got.cpu(), rule.cpu()), M


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    """-inf rows, +inf, the dtype's extremes, -0 beside +0 and NaN, spread over several programs."""
    K, V, first = 4, 3000, 1
    u = logits(K, V, torch.float32, seed=9).to(dtype)
    info = torch.finfo(dtype)
    u[first:, 10:400] = float("-inf")  # columns whose every scored row is -inf
    u[first:, 500:700] = 0.0
    u[2, 500:600] = -0.0  # max(-0, +0) and -0 alone: one value
    u[1:, 600:650] = -0.0
    u[3, 900] = float("inf")
    u[1, 1200] = info.max
    u[2, 1300:1310] = -info.max
    u[1, 2100] = float("nan")
    u[3, 2500] = info.tiny
    u[2, 2999] = -info.tiny
    positive = int((u[first:].amax(0).float() > 0).sum())  # then 200 zeros, 50 of them -0 only (600..649)
    for M in (1, 3, 50, 1500, positive + 120, positive + 210, V - 1):
        got, ref = select(u, first, M, 256), pool_select_reference(u, first, M)
        assert torch.equal(got.cpu(), ref.cpu()), (M, got[:8].tolist(), ref[:8].tolist())
    assert select(u, first, 2, 256).tolist() == [900, 2100]  # NaN and +inf are the two largest
    assert 1200 in select(u, first, 3, 256).tolist()


@pytest.mark.parametrize("M, first", [(0, 1), (-1, 1), (3000, 1), (3005, 1), (10, 4), (10, 5)])
def test_full_vocabulary_is_none(M, first):
    u = logits(4, 3000, torch.bfloat16)
    assert pool_select(u, first, M) is None and pool_select_reference(u, first, M) is None
    assert candidate_pool(u, first, M) is None


def test_workspace_is_reused_and_left_clean():
    """One workspace, calls on different inputs: each right, the histograms zero after each call,
    and the ids always in the workspace's own buffer (a CUDA graph's static output)."""
    K, V, M = 15, 4001, 300
    ws = pool_workspace(V, M, torch.bfloat16, DEVICE, block=512)
    for seed in range(3):
        u = logits(K, V, torch.bfloat16, seed=seed, scale=1.0 + seed)
        got = pool_select(u[: K - seed], 1, M, ws)
        assert got.data_ptr() == ws.ids.data_ptr()
        assert torch.equal(got.cpu(), pool_select_reference(u[: K - seed], 1, M).cpu()), seed
        assert int(ws.hist.abs().sum()) == 0


def test_other_dtypes_and_mismatched_workspaces_are_refused():
    u = logits(3, 3000, torch.float64)
    with pytest.raises(ValueError, match="float64"):
        pool_select(u, 1, 10)
    ws = pool_workspace(3000, 10, torch.bfloat16, DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        pool_select(u.float(), 1, 10, ws)  # 32-bit keys on a 16-bit workspace
    with pytest.raises(ValueError, match="workspace"):
        pool_select(u.to(torch.bfloat16), 1, 11, ws)


def test_engine_refuses_a_pool_it_cannot_select():
    from dominospec.engine.graphs import DraftGraphs
    from dominospec.errors import UserError

    with pytest.raises(UserError, match="engine.candidate_pool"):
        DraftGraphs(8, 32, 96, torch.float64, DEVICE, enabled=False).pool_workspace(13)
    assert DraftGraphs(8, 32, 96, torch.float64, DEVICE, enabled=False).pool_workspace(0) is None
