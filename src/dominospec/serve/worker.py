"""The one engine thread: requests queue for it, it generates one at a time (batch size 1).

The event loop never runs torch: a request becomes a `Job`, `EngineWorker.submit` puts it in a
bounded queue (full -> `queue.Full`, the app answers 503), and the worker thread runs
`SpecEngine.generate` on it. Results travel back to the loop through the job's asyncio queue:
  ("tokens", ids)       after every step, for streaming jobs only
  ("done", Generation)  once, at the end (finish_reason "abort" when the client went away)
  ("error", exception)  once, instead of "done", when generation raised
A client that disconnects cancels its job: a queued job is then skipped, a running one stops at
the next step (`on_tokens` returns False).

`Counters` are the totals `/server_info` reports; τ is pooled over every generation that ran
(finished or aborted): completion tokens ÷ verify rounds, bonus and prefill token included, as
SGLang's `avg_spec_accept_length`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from dominospec.engine import Sampling, SpecEngine


@dataclass
class Job:
    """One generation request, as the worker sees it."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_strings: tuple[str, ...]
    seed: Optional[int]
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client is gone (or the answer is complete): stop working on this job."""
        self.cancelled.set()

    def emit(self, kind: str, payload: Any) -> None:
        """Worker thread -> event loop; dropped when the loop has closed (server shutting down)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:
            pass


@dataclass
class Counters:
    """Totals since start; written by the worker thread under `lock`, read by the loop."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    received: int = 0  # accepted into the queue
    rejected: int = 0  # queue full: 503
    completed: int = 0  # finished with stop or length
    aborted: int = 0  # client gone mid-generation
    skipped: int = 0  # client gone while queued
    failed: int = 0  # generation raised
    running: int = 0
    completion_tokens: int = 0  # over every generation that ran, aborted ones included
    verify_rounds: int = 0

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}


class EngineWorker:
    """One daemon thread running `engine.generate` for queued jobs, at most `max_queue` waiting."""

    def __init__(self, engine: SpecEngine, max_queue: int):
        self.engine = engine
        self.jobs: queue.Queue[Optional[Job]] = queue.Queue(maxsize=max_queue)
        self.counters = Counters()
        self.thread = threading.Thread(target=self._run, name="dominospec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        """Queue a job; raises queue.Full when `max_queue` jobs are already waiting."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            with self.counters.lock:
                self.counters.rejected += 1
            raise
        with self.counters.lock:
            self.counters.received += 1

    def stop(self) -> None:
        """Cancel every waiting job and ask the thread to end after the current one."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                with self.counters.lock:
                    self.counters.skipped += 1
                continue
            self._generate(job)

    def _generate(self, job: Job) -> None:
        def on_tokens(ids: list[int]) -> bool:
            if job.stream:
                job.emit("tokens", ids)
            return not job.cancelled.is_set()

        with self.counters.lock:
            self.counters.running += 1
        try:
            generation = self.engine.generate(job.prompt_ids, job.max_new_tokens, job.sampling, job.stop_strings,
                                              seed=job.seed, on_tokens=on_tokens)
        except Exception as err:  # one bad request must not end the worker
            traceback.print_exc()
            with self.counters.lock:
                self.counters.running -= 1
                self.counters.failed += 1
            job.emit("error", err)
            return
        with self.counters.lock:
            self.counters.running -= 1
            if generation.finish_reason == "abort":
                self.counters.aborted += 1
            else:
                self.counters.completed += 1
            self.counters.completion_tokens += generation.stats.new_tokens
            self.counters.verify_rounds += generation.stats.rounds
        job.emit("done", generation)
