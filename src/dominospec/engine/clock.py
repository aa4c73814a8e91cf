"""Phase times of a generation's rounds, without stalling the GPU to read them.

A round is draft forward -> head rollout -> verify. Timing each phase with a wall clock needs a
`torch.cuda.synchronize` at every boundary, so the host cannot queue the next phase's launches
(a graph replay, a kernel) while the GPU runs the current one: on an H200 with SmolLM2 that stall
cost 0.3-0.6 ms of a 5.6 ms round (benchmarks/round_profile_gpu.py). On CUDA a mark is an event
recorded on the current stream; the gaps between marks are device time, read once, after the
generation's last round has synchronised. On CPU a mark is `time.perf_counter()`, and so it is on
CUDA for rounds that draft nothing (a plain step waits for its one forward anyway, and recording
events there cost 0.1-0.6 ms a step on the H200's sandboxed host).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class PhaseClock:
    """`mark()` a boundary, `add(name, a, b)` the span from mark a to mark b; `seconds()` -> totals
    per name (on CUDA it synchronises once, then reads every span).

    CUDA events come from `pool` and go back to it once read: creating one is a driver call that
    costs more than recording one, and a drafting round marks four. A pool may be shared by the
    clocks of one engine (list append/pop are atomic)."""

    def __init__(self, device: torch.device, pool: Optional[list] = None):
        self.cuda = device.type == "cuda"
        self.pool = pool if pool is not None else []  # recorded and read: free to record again
        self.marks: list = []  # events recorded since the last seconds()
        self.spans: list[tuple[str, Mark, Mark]] = []
        self.totals: dict[str, float] = {}

    def mark(self, device: bool = True) -> Mark:
        """A boundary: a CUDA event where the clock is on CUDA and `device`, else the host clock. A
        span joins two marks of the same kind. Host marks suit a round that queues nothing the host
        does not wait for (a plain step: its acceptance synchronises), and cost no event record."""
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


def book_phases(clock: PhaseClock, stats: Any, marks: tuple, host: tuple, drafted: bool) -> None:
    """A round's clock marks (t0 draft t1 rollout t2 verify t3) and host marks (plan | launch | wait |
    commit) -> its phase times in `clock`, the host's in `stats.host_s` (engine.stats); `drafted`: it
    verified at least one draft (a draft round)."""
    t0, t1, t2, t3 = marks
    clock.add("draft", t0, t1)
    clock.add("rollout", t1, t2)
    clock.add("verify", t2, t3)
    if drafted:
        clock.add("draft_round", t0, t3)
    for phase, a, b in zip(("plan", "launch", "wait", "commit"), host, host[1:]):
        stats.host_s[phase] = stats.host_s.get(phase, 0.0) + (b - a)
