"""Independent replies decoded in large batches on one static KV cache: the regenerate stage's fast path.

    decoder = StaticDecoder(forward, policy, max_new_tokens, graphs=True, prefill_tokens=16384)
    decoder.run(jobs, on_reply)      # on_reply(job index, Reply) as each reply ends, in any order

A job (`ReplyJob`) is one reply to one prompt: its token ids, a budget, a temperature and a seed. The
S slots of `BatchForward` each hold one job at a time. The decoder keeps every reply's state on the
device, one row per slot:

    last [S]        the token picked last (the next step's input; not yet in the cache)
    length [S]      tokens in the slot's cache = the next step's position
    count [S]       reply tokens picked so far;  reply [S, R]: them, R = max_new_tokens
    budget, temperature, seed [S];  active, finished, stopped [S] bool;  cut [S] (-1: no loop)

One decode step of rows 0..B-1 is a forward of their `last` tokens (`BatchForward.decode`: with
`rows` attention each row reads its own cached columns; with `padded` every row reads the columns
[0, cols), cols the busy rows' longest rounded up to COLUMN_STEP; free and finished rows read one),
the pick (`picking.pick`: greedy, or a draw from the reply's own seed), and the push of each active
row's token: it ends on a stop token, on a repetition loop (`loops.loop_cuts`, the cut
`LoopDetector` would make), or at its budget. On CUDA each step is one CUDA graph per key (B, cols,
sampled; cols is fixed with `rows` attention), captured on first use after warm-ups that restore the state they advance, all graphs
sharing one memory pool (they never run at once, and they keep nothing between replays but the
state buffers). The host reads only which rows finished (one [B] copy a step); it never touches a
running reply's tokens.

Scheduling. Jobs are taken in the given order (the stage sorts them by prompt length, so rows that
run together have similar lengths and `cols` stays close to what they hold). Free rows are refilled
once 1/`refill` of them are free (an eighth by default; or none runs): their prompts are prefilled together, right-padded,
in forwards of <= `prefill_tokens` tokens. When no job is left to start, the running rows are moved
into the lowest rows as soon as they fit the next smaller row bucket (powers of two), so the tail
of a run costs what it decodes.

Greedy replies are today's decoder's (`ReplyStream`) token for token, in fp32: the same stop, loop
and budget rules, the same argmax of the same function (tests/regenerate/test_static_decoder.py).
"""

from __future__ import annotations

import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from dominospec.regenerate.batch_forward import BatchForward
from dominospec.regenerate.decoder import DecodePolicy, Reply
from dominospec.regenerate.loops import loop_cuts
from dominospec.regenerate.picking import pick

REFILL = 8  # free rows are refilled once 1/REFILL of the rows are free (the default of `refill`)
COLUMN_STEP = 128  # the attention reads the columns up to the next multiple of this
MIN_ROWS = 8  # the smallest row bucket
WARMUPS = 2  # eager runs of a step before its capture (Triton compiles, cuBLAS allocates)


@dataclass(frozen=True)
class ReplyJob:
    """One reply to decode: prompt token ids, at most `budget` tokens, picked at `temperature` (0: greedy)."""

    prompt: tuple[int, ...]
    budget: int
    temperature: float = 0.0
    seed: int = 0


class _State:
    """The replies' device state, one row per slot (module docstring)."""

    NAMES = ("last", "length", "count", "budget", "seed", "cut", "temperature", "active", "finished", "stopped", "reply")

    def __init__(self, slots: int, max_new_tokens: int, device: torch.device):
        def longs() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.long, device=device)

        def flags() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.bool, device=device)

        self.last, self.length, self.count, self.budget, self.seed, self.cut = (longs() for _ in range(6))
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.active, self.finished, self.stopped = flags(), flags(), flags()
        self.reply = torch.zeros(slots, max_new_tokens, dtype=torch.long, device=device)  # [S, R]

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.NAMES]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.tensors(), saved):
            t.copy_(s)

    def move(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        for t in self.tensors():
            t[targets] = t[sources]


class StaticDecoder:
    """Replies of many jobs decoded together on `forward`'s slots (module docstring)."""

    def __init__(self, forward: BatchForward, policy: DecodePolicy, max_new_tokens: int, graphs: bool,
                 prefill_tokens: int, refill: int = REFILL):
        self.forward, self.policy, self.prefill_tokens, self.refill = forward, policy, prefill_tokens, refill
        self.slots, self.device = forward.slots, forward.device
        self.graphs_on = graphs and self.device.type == "cuda"
        self.state = _State(self.slots, max_new_tokens, self.device)
        self.stop_ids = torch.tensor(sorted(policy.stop_ids), dtype=torch.long, device=self.device)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.failures: dict[tuple, str] = {}  # keys whose capture failed (run eagerly), with the error
        self.pool = None
        self.buckets = row_buckets(self.slots)

    def run(self, jobs: Sequence[ReplyJob], on_reply: Callable[[int, Reply], None],
            on_tokens: Optional[Callable[[int], None]] = None) -> None:
        """Decode every job; `on_reply(job index, Reply)` as each ends; `on_tokens(n)` after each step of n rows."""
        for i, job in enumerate(jobs):
            if not job.prompt or job.budget < 1 or len(job.prompt) + job.budget - 1 > self.forward.capacity:
                raise ValueError(f"job {i}: a prompt of {len(job.prompt)} tokens and a budget of {job.budget} "
                                 f"do not fit a cache of {self.forward.capacity} columns")
        self.jobs, self.on_reply = jobs, on_reply
        # host mirrors, one entry per row: its job (-1: free), tokens in its cache, whether it samples
        self.row_job = np.full(self.slots, -1, dtype=np.int64)
        self.lengths = np.zeros(self.slots, dtype=np.int64)
        self.hot = np.zeros(self.slots, dtype=bool)
        queue, B = deque(range(len(jobs))), self.slots
        with torch.inference_mode():
            self.state.active.zero_()
            self.state.finished.zero_()
            while True:
                busy = np.flatnonzero(self.row_job[:B] >= 0)
                free = np.flatnonzero(self.row_job[:B] < 0)
                if queue and len(free) and (len(free) >= max(1, B // self.refill) or not len(busy)):
                    self._refill(free.tolist(), queue)
                    self._harvest(B)
                    continue
                if not len(busy):
                    break
                if not queue:
                    B = self._shrink(B, busy.tolist())
                    busy = np.flatnonzero(self.row_job[:B] >= 0)
                cols = self._columns(busy)
                self._run_step((B, cols, bool(self.hot[busy].any())))
                self.lengths[busy] += 1
                if on_tokens is not None:
                    on_tokens(len(busy))
                self._harvest(B)

    def _columns(self, busy: np.ndarray) -> int:
        """The columns a step's padded attention reads: the busy rows' longest, rounded up to COLUMN_STEP
        (`rows` attention reads each row's own length: the capacity, one graph per row bucket)."""
        if self.forward.attention == "rows":
            return self.forward.capacity
        return min(self.forward.capacity, -(-(int(self.lengths[busy].max()) + 1) // COLUMN_STEP) * COLUMN_STEP)

    def _refill(self, free: list[int], queue: deque) -> None:
        """Start the next jobs in the free rows: prefills of <= prefill_tokens (right-padded) tokens each."""
        taken = [(row, queue.popleft()) for row in free[: len(queue)]]
        start = 0
        while start < len(taken):
            end, longest = start, 0
            while end < len(taken):
                longest_next = max(longest, len(self.jobs[taken[end][1]].prompt))
                if end > start and longest_next * (end - start + 1) > self.prefill_tokens:
                    break
                longest, end = longest_next, end + 1
            self._prefill(taken[start:end], longest)
            start = end

    def _prefill(self, batch: list[tuple[int, int]], width: int) -> None:
        """(row, job) pairs -> their prompts prefilled into the rows, first tokens picked and pushed."""
        st, jobs = self.state, [self.jobs[j] for _, j in batch]
        rows = torch.tensor([r for r, _ in batch], device=self.device)
        ids = torch.full((len(batch), width), self.policy.pad_id, dtype=torch.long)
        for i, job in enumerate(jobs):
            ids[i, : len(job.prompt)] = torch.tensor(job.prompt)
        lengths = torch.tensor([len(job.prompt) for job in jobs], device=self.device)
        logits = self.forward.prefill(rows, ids.to(self.device), lengths)  # [n, V]
        temperature = torch.tensor([job.temperature for job in jobs], dtype=torch.float32, device=self.device)
        seeds = torch.tensor([job.seed for job in jobs], dtype=torch.long, device=self.device)
        budget = torch.tensor([job.budget for job in jobs], device=self.device)
        zeros = torch.zeros(len(batch), dtype=torch.long, device=self.device)
        token = pick(logits, temperature, seeds, zeros, self.policy.top_p, bool((temperature > 0).any()))
        reply = st.reply[rows]
        active = torch.ones(len(batch), dtype=torch.bool, device=self.device)
        count, finished, stopped, cut = self._push(reply, zeros, budget, active, token)
        st.reply[rows] = reply
        for name, value in (("last", token), ("length", lengths), ("count", count), ("budget", budget),
                            ("seed", seeds), ("cut", cut), ("temperature", temperature), ("active", ~finished),
                            ("finished", finished), ("stopped", stopped)):
            getattr(st, name)[rows] = value
        for (row, job), n in zip(batch, lengths.tolist()):
            self.row_job[row], self.lengths[row], self.hot[row] = job, n, self.jobs[job].temperature > 0

    def _step(self, B: int, cols: int, sampled: bool) -> None:
        """One decode step of rows 0..B-1 on the state buffers (tensor ops only: the graph's body)."""
        st = self.state
        active = st.active[:B].clone()
        # a free or finished row writes its (unused) K/V at column 0 and reads that column alone
        positions = torch.where(active, st.length[:B], 0)
        logits = self.forward.decode(st.last[:B], positions, cols, torch.where(active, positions + 1, 1))  # [B, V]
        token = pick(logits, st.temperature[:B], st.seed[:B], st.count[:B], self.policy.top_p, sampled)
        st.length[:B] += active.long()
        count, finished, stopped, cut = self._push(st.reply[:B], st.count[:B], st.budget[:B], active, token)
        st.count[:B].copy_(count)
        st.finished[:B].copy_(finished)
        st.stopped[:B].copy_(stopped)
        st.cut[:B].copy_(cut)
        st.active[:B].copy_(active & ~finished)
        st.last[:B].copy_(torch.where(active, token, st.last[:B]))

    def _push(self, reply: torch.Tensor, count: torch.Tensor, budget: torch.Tensor, active: torch.Tensor,
              token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """token [n] appended to the active rows of reply [n, R] (in place) -> (count, finished, stopped, cut) [n]."""
        column = count.clamp(max=reply.shape[1] - 1)[:, None]
        reply.scatter_(1, column, torch.where(active, token, reply.gather(1, column)[:, 0])[:, None])
        count = count + active.long()
        stopped = active & (token[:, None] == self.stop_ids[None, :]).any(-1)
        cut = loop_cuts(reply, count, self.policy.loop_ngram or 0, self.policy.loop_repeats)
        cut = torch.where(active & ~stopped, cut, torch.full_like(cut, -1))
        finished = active & (stopped | (cut >= 0) | (count >= budget))
        return count, finished, stopped, cut

    def _harvest(self, B: int) -> None:
        """Hand the replies that finished to `on_reply` and free their rows."""
        st = self.state
        rows = st.finished[:B].nonzero().flatten()
        if rows.numel() == 0:
            return
        counts, stopped, cuts = st.count[rows].tolist(), st.stopped[rows].tolist(), st.cut[rows].tolist()
        replies = st.reply[rows].tolist()
        st.finished[rows] = False
        for row, n, stop, cut, tokens in zip(rows.tolist(), counts, stopped, cuts, replies):
            kept = tokens[: n - 1] if stop else tokens[:cut] if cut >= 0 else tokens[:n]
            job, self.row_job[row] = int(self.row_job[row]), -1
            self.on_reply(job, Reply(tokens=kept, generated=n, stopped=stop, loop_cut=cut >= 0, unfed=[],
                                     stop=tokens[n - 1] if stop else None))

    def _shrink(self, B: int, busy: list[int]) -> int:
        """No job left to start: busy rows -> the lowest rows of the smallest bucket that holds them -> that bucket."""
        new = next(b for b in self.buckets if b >= len(busy))
        if new >= B:
            return B
        sources = [r for r in busy if r >= new]
        targets = np.flatnonzero(self.row_job[:new] < 0)[: len(sources)].tolist()
        if sources:
            cols = int(self.lengths[sources].max()) + 1
            src, dst = (torch.tensor(x, device=self.device) for x in (sources, targets))
            self.forward.move(src, dst, cols)
            self.state.move(src, dst)
            for mirror in (self.row_job, self.lengths, self.hot):
                mirror[targets] = mirror[sources]
            self.row_job[sources] = -1
        self.state.active[new:].zero_()
        return new

    def _run_step(self, key: tuple[int, int, bool]) -> None:
        """One step of `key` (B, cols, sampled): its CUDA graph's replay (captured on first use), or eager."""
        if not self.graphs_on or key in self.failures:
            return self._step(*key)
        if key not in self.graphs:
            saved = self.state.snapshot()
            try:
                self.graphs[key] = self._capture(key, saved)
            except Exception:  # noqa: BLE001 - a key whose capture fails runs eagerly
                self.failures[key] = traceback.format_exc(limit=4)
                torch.cuda.synchronize()
                self.state.restore(saved)
                return self._step(*key)
            self.state.restore(saved)
        self.graphs[key].replay()

    def _capture(self, key: tuple[int, int, bool], saved: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        """Warm-ups on a side stream (each from the saved state), then one capture (not replayed)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUPS):
                self.state.restore(saved)
                self._step(*key)
        torch.cuda.current_stream().wait_stream(stream)
        self.state.restore(saved)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(*key)
        return graph


def row_buckets(slots: int) -> list[int]:
    """Slots -> the row counts a step runs at: MIN_ROWS, 2 MIN_ROWS, .. (powers of two) below `slots`, then `slots`."""
    buckets, rows = [], MIN_ROWS
    while rows < slots:
        buckets.append(rows)
        rows *= 2
    return buckets + [slots]
