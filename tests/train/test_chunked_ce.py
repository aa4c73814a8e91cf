"""`chunked_cross_entropy` equals F.cross_entropy on fp32 logits: losses and gradients.

Run: python -m pytest tests/train/test_chunked_ce.py -q
"""

import pytest
import torch
import torch.nn.functional as F

from dominospec.train.chunked_ce import CHUNK_ROWS, chunked_cross_entropy


def reference(logits, labels):
    return F.cross_entropy(logits.float(), labels, reduction="none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, CHUNK_ROWS, 2 * CHUNK_ROWS + 7])
def test_losses_and_gradients_match_the_reference(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    base = (2 * torch.randn(rows, 1003, generator=g)).to(dtype)  # odd V
    labels = torch.randint(0, 1003, (rows,), generator=g)
    weights = 0.5 + torch.rand(rows, generator=g)
    ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    loss_ours, loss_ref = chunked_cross_entropy(ours, labels), reference(ref, labels)
    torch.testing.assert_close(loss_ours, loss_ref, rtol=0, atol=1e-5)
    (weights * loss_ours).sum().backward()
    (weights * loss_ref).sum().backward()
    assert ours.grad.dtype == dtype
    # fp32: the same numbers up to summation order; bf16: both round the same fp32 gradient once
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(ours.grad, ref.grad, **tol)
    assert ours.grad.float().abs().max() > 1e-2  # the comparison is not between zeros


def test_a_wrong_label_is_noticed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    labels = torch.randint(0, 50, (5,), generator=g)
    shifted = (labels + 1) % 50
    assert not torch.allclose(chunked_cross_entropy(logits, shifted), reference(logits, labels), atol=1e-3)


def test_chunks_are_small_on_a_cpu_and_large_on_an_accelerator():
    from dominospec.train.chunked_ce import DEVICE_CHUNK_BYTES, chunk_rows

    assert chunk_rows(torch.empty(10, 49152)) == CHUNK_ROWS
    # any non-CPU device: chunks of up to DEVICE_CHUNK_BYTES fp32 (meta allocates nothing)
    rows = chunk_rows(torch.empty(10, 49152, device="meta"))
    assert rows == DEVICE_CHUNK_BYTES // (4 * 49152) and rows * 4 * 49152 <= DEVICE_CHUNK_BYTES
    assert rows > 20 * CHUNK_ROWS
    assert chunk_rows(torch.empty(10, 10**8, device="meta")) == CHUNK_ROWS  # never below the CPU's


@pytest.mark.parametrize("chunk", [7, 10_000])
def test_any_chunk_size_gives_the_same_losses_and_gradients(monkeypatch, chunk):
    import dominospec.train.chunked_ce as chunked_ce

    monkeypatch.setattr(chunked_ce, "CHUNK_ROWS", chunk)  # one chunk per 7 rows, or all rows in one
    g = torch.Generator().manual_seed(chunk)
    base = torch.randn(150, 211, generator=g)
    labels = torch.randint(0, 211, (150,), generator=g)
    ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    torch.testing.assert_close(chunked_cross_entropy(ours, labels), reference(ref, labels), rtol=0, atol=1e-5)
    chunked_cross_entropy(ours, labels).sum().backward()
    reference(ref, labels).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-6)


def test_the_ce_switch_keeps_the_torch_chunks_off_cuda_and_refuses_triton_where_it_cannot_run(monkeypatch):
    """train.ce_kernel: torch and auto (off CUDA) give the chunks; triton on a CPU without the
    interpreter is a UserError that names the key (the kernel itself: tests/kernels/test_cross_entropy.py)."""
    from dominospec.errors import UserError
    from dominospec.train.chunked_ce import row_cross_entropy

    cpu = torch.device("cpu")
    assert row_cross_entropy("torch", cpu) is chunked_cross_entropy
    assert row_cross_entropy("auto", cpu) is chunked_cross_entropy
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="train.ce_kernel: triton cannot run on cpu"):
        row_cross_entropy("triton", cpu)
