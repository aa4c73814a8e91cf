"""Phase times of a generation's rounds, without stalling the GPU to read them.

Timing each phase with a wall clock needs a synchronize at every boundary, so the host could not queue
the next phase while the GPU runs this one (about a tenth of a round on an H200 with SmolLM2:
docs/journal/2026-12-04-a-round-without-stalls-the-fused-pool-selection-and-the-cpu.md). On CUDA a
mark is an event on the current stream, read once after the generation's last round; on CPU, and for
rounds that draft nothing (a plain step waits for its one forward anyway), `time.perf_counter()`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class PhaseClock:
    """`mark()` a boundary, `add(name, a, b)` the span from mark a to mark b; `seconds()` -> totals per name
    (on CUDA one synchronise, then every span). CUDA events come from `pool`, shared by one engine's
    clocks, and go back once read: creating one costs more than recording one."""

    def __init__(self, device: torch.device, pool: Optional[list] = None):
        self.cuda = device.type == "cuda"
        self.pool = pool if pool is not None else []  # recorded and read: free to record again
        self.marks: list = []  # events recorded since the last seconds()
        self.spans: list[tuple[str, Mark, Mark]] = []
        self.totals: dict[str, float] = {}

    def mark(self, device: bool = True) -> Mark:
        """A boundary: a CUDA event where the clock is on CUDA and `device`, else the host clock (a span
        joins two marks of one kind)."""
        if self.cuda and device:
            try:
                event = self.pool.pop()
            except IndexError:
                event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
            return event
        return time.perf_counter()

    def add(self, name: str, start: Mark, end: Mark) -> None:
        if not isinstance(start, float):
            self.spans.append((name, start, end))
        else:
            self.totals[name] = self.totals.get(name, 0.0) + (end - start)

    @contextmanager
    def round(self, stats: Any) -> Iterator["RoundTimer"]:
        """A round's phase times (`RoundTimer`), booked here and in `stats.host_s` when it ends."""
        timer = RoundTimer(self, stats)
        try:
            yield timer
        finally:
            timer.close()

    def seconds(self) -> dict[str, float]:
        """Total seconds per name over every span added so far."""
        if self.cuda and self.marks:
            self.marks[-1].synchronize()  # one stream: the last event recorded completes last
            for name, start, end in self.spans:
                self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1000
            self.spans.clear()
            self.pool.extend(self.marks)
            self.marks.clear()
        return dict(self.totals)


class RoundTimer:
    """One round's phases (`PhaseClock.round`): the host's plan until `begin`, then `phase(name)` blocks
    (launch), `waiting()` (the acceptance's read) and the commit to the end. Consecutive phases share a
    mark; on exit the spans go to the clock, with `draft_round` when `drafted` (a proposal verified)."""

    def __init__(self, clock: "PhaseClock", stats: Any):
        self.clock, self.stats = clock, stats
        self.host = [time.perf_counter()]  # plan | launch | wait | commit boundaries
        self.device = False
        self.first: Optional[Mark] = None  # the mark `begin` took
        self.last: Optional[Mark] = None  # the end of the latest phase
        self.drafted = False

    def begin(self, device: bool) -> None:
        """The plan is made; `device`: the phases are timed by CUDA events (the host clock otherwise)."""
        self.host.append(time.perf_counter())
        self.device = device
        self.first = self.last = self.clock.mark(device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.last if self.last is not None else self.clock.mark(self.device)
        yield
        self.last = self.clock.mark(self.device)
        self.clock.add(name, start, self.last)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The host waits here for the device (the acceptance reads the verify's logits)."""
        self.host.append(time.perf_counter())
        yield
        self.host.append(time.perf_counter())

    def close(self) -> None:
        self.host.append(time.perf_counter())
        if self.drafted and self.first is not None and self.last is not None:
            self.clock.add("draft_round", self.first, self.last)
        if len(self.host) == 5:  # a round that waited once: plan | launch | wait | commit
            for phase, a, b in zip(("plan", "launch", "wait", "commit"), self.host, self.host[1:]):
                self.stats.host_s[phase] = self.stats.host_s.get(phase, 0.0) + (b - a)
