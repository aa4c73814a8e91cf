"""engine.clock: phase spans add up per name, on CPU by wall clock and on CUDA by events."""

import time

import pytest
import torch

from dominospec.engine.clock import PhaseClock


def _spans(clock: PhaseClock, work) -> dict[str, float]:
    a = clock.mark()
    work()
    b = clock.mark()
    work()
    work()
    c = clock.mark()
    clock.add("one", a, b)
    clock.add("two", b, c)
    clock.add("one", b, c)
    return clock.seconds()


def test_cpu_spans_sum_per_name():
    totals = _spans(PhaseClock(torch.device("cpu")), lambda: time.sleep(0.02))
    assert 0.04 <= totals["two"] < 0.2  # two sleeps of 20 ms
    assert 0.06 <= totals["one"] < 0.3  # the first span (one sleep) plus the second (two)
    assert totals["one"] > totals["two"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="events need CUDA")
def test_cuda_spans_are_device_time_and_need_no_sync_per_mark():
    x = torch.randn(2048, 2048, device="cuda")
    work = lambda: [x @ x for _ in range(20)]  # noqa: E731
    work()  # cuBLAS picks its kernel on the first call: not part of the spans
    torch.cuda.synchronize()
    clock = PhaseClock(torch.device("cuda"))
    totals = _spans(clock, work)
    assert 0 < totals["two"] < totals["one"]
    ratio = totals["two"] / (totals["one"] - totals["two"])  # two batches of work against one
    assert 1.5 < ratio < 2.5
    assert clock.seconds() == totals  # reading again adds nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="events need CUDA")
def test_cuda_events_return_to_the_pool_and_are_reused():
    pool: list = []
    first = PhaseClock(torch.device("cuda"), pool)
    a, b = first.mark(), first.mark()
    first.add("x", a, b)
    first.seconds()
    assert sorted(map(id, pool)) == sorted([id(a), id(b)])
    second = PhaseClock(torch.device("cuda"), pool)
    assert {id(second.mark()), id(second.mark())} == {id(a), id(b)} and not pool


@pytest.mark.skipif(not torch.cuda.is_available(), reason="events need CUDA")
def test_host_marks_on_cuda_record_no_event_and_time_on_the_host():
    clock = PhaseClock(torch.device("cuda"))
    a = clock.mark(device=False)
    time.sleep(0.01)
    b = clock.mark(device=False)
    clock.add("plain", a, b)
    c, d = clock.mark(), clock.mark()
    clock.add("drafting", c, d)
    assert not isinstance(c, float) and len(clock.marks) == 2  # only the device marks are events
    totals = clock.seconds()
    assert totals["plain"] >= 0.01 and 0 <= totals["drafting"] < 0.01


def test_on_cpu_every_mark_reads_the_clock():
    clock = PhaseClock(torch.device("cpu"))
    a = clock.mark()
    time.sleep(0.01)
    assert clock.mark(device=False) - a >= 0.01
