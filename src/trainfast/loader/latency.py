"""Reads that wait: noticing them (`probe_reads`), the thread pool that hides their latency (`size_pool`,
`PoolGrowth`) and what the loader threads measured (`FetchStats`, `FetchCounter`).

Data on NFS or object storage makes each read wait milliseconds for its first byte while the CPU idles. Cores do
not help there, concurrency does: Little's law, batches in flight = the rate wanted x the time a batch takes. A
read is "waiting" when the CPU is busy for less than `WAITING_BUSY` of its wall time; a pipeline whose reads are
busy keeps `make_loader`'s CPU-sized plan exactly. The probe returns within about `PROBE_DEADLINE_S` whatever a read
does: storage at scale stalls now and then, and a read still running at the deadline is timed up to it (a stall
waits: it tips the plan toward threads) and cannot touch the training afterwards (`trainfast.loader.timed_reads`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainfast.loader.timed_reads import CutOff, time_reads
from trainfast.units import format_bytes

# Below this share of their wall time on the CPU, reads wait more than they work: more threads than cores pay.
WAITING_BUSY = 0.5
# The probe at resolve time: at most this many timed reads and about this long, unless one read takes longer; and
# whatever a read does, make_loader goes on after PROBE_DEADLINE_S (a stalled read is cut off there: a 20 s stall
# made make_loader take 20 s, a hung read forever).
PROBE_READS = 8
PROBE_BUDGET_S = 0.25
PROBE_DEADLINE_S = 1.0
# Most threads a pool hiding read latency grows to: 64 x 20 ms reads overlap into ~3,200 samples/s from one
# process; past that, the GIL's hand-offs between threads cost the training thread more than the reads gain.
MAX_THREADS = 64
# Batches in flight take at most this share of the memory available when the loader is planned.
MEMORY_SHARE = 0.125
# The training waits for batches more than this share of its time: the loader is the limit, the pool grows.
WAIT_SHARE = 0.05
# The pool is sized for this much more than Little's law's mean, for the spread of read times: in-order batches
# wait for their slowest one.
HEADROOM = 1.25
# Each growth decision measures at least this long and this many batches (a few steps' noise is not a trend).
WINDOW_S = 0.5
WINDOW_BATCHES = 4


@dataclass(frozen=True)
class FetchStats:
    """What a `ThreadLoader`'s threads measured since it was built: `batches` fetched, the wall and the thread CPU
    seconds summed inside those fetches, the pool's size now (`threads`), and the seconds inside the fetches that
    the threads were ready to run but waited for a CPU (`queued_s`; 0 where the system does not tell)."""

    batches: int
    wall_s: float
    cpu_s: float
    threads: int
    queued_s: float = 0.0

    @property
    def busy(self) -> float | None:
        """Share of the fetches' wall time on the CPU (below `WAITING_BUSY`: they mostly wait); None before any."""
        return self.cpu_s / self.wall_s if self.batches and self.wall_s > 0 else None


class FetchCounter:
    """Per-batch wall, thread CPU and CPU-queue seconds, summed under a lock by every loader thread (four additions
    a batch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches, self.wall_s, self.cpu_s, self.queued_s = 0, 0.0, 0.0, 0.0

    def add(self, wall_s: float, cpu_s: float, queued_s: float) -> None:
        with self._lock:
            self.batches += 1
            self.wall_s += wall_s
            self.cpu_s += cpu_s
            self.queued_s += queued_s

    def stats(self, threads: int) -> FetchStats:
        with self._lock:
            return FetchStats(self.batches, self.wall_s, self.cpu_s, threads, self.queued_s)


@dataclass(frozen=True)
class ReadProbe:
    """A few of a dataset's reads timed apart from the training: their number, wall and CPU seconds, the seconds
    they were ready to run but waited for a CPU (`queued_s`: another process had it), and a sample's bytes when its
    tensors tell (None otherwise). A read still running at the probe's deadline (`cut_off`) is not among the
    `reads`, but its seconds up to the deadline are in the sums: a stall that waits counts as waiting."""

    reads: int
    wall_s: float
    cpu_s: float
    sample_bytes: int | None
    queued_s: float = 0.0
    cut_off: CutOff | None = None

    @property
    def busy(self) -> float:
        """Share of the reads' own time on the CPU: their wall time less the time they waited for a CPU, which is
        neither work nor I/O (another process had the CPU)."""
        own = self.wall_s - self.queued_s
        return min(1.0, self.cpu_s / own) if own > 0 else 1.0

    @property
    def waiting(self) -> bool:
        return self.busy < WAITING_BUSY

    def describe(self) -> str:
        if self.cut_off is None:
            return (f"{self.reads} read(s) of {1000 * self.wall_s / self.reads:.1f} ms each, "
                    f"{self.busy:.0%} of it on the CPU")
        cut = self.cut_off
        done = (f"{self.reads} read(s) of {1000 * (self.wall_s - cut.wall_s) / self.reads:.1f} ms each and "
                if self.reads else "")
        unknown = "" if cut.cpu_known else " (its CPU time unknown, counted as none)"
        return f"{done}1 read (sample {cut.index}) still running after {cut.wall_s:.1f} s{unknown}, " \
               f"{self.busy:.0%} of the time on the CPU"


def probe_reads(dataset: Any, length: int, *, reads: int = PROBE_READS, budget_s: float = PROBE_BUDGET_S,
                deadline_s: float = PROBE_DEADLINE_S, fork: bool | None = None) -> ReadProbe | None:
    """Time up to `reads` reads `dataset[i]`, spread over its `length` samples, for about `budget_s` (one read more
    when the first is slower), after one untimed read: a first read may open files or a connection once. Returns
    within about `deadline_s` whatever a read does: a read still running then is timed up to it (`cut_off`).

    The reads run in a forked child (Linux; `fork` False: in a thread), so that a read left running cannot draw
    from the training's global RNGs, raise or keep handles open after the probe returns (`timed_reads`). The CPU
    time is that process's, not the thread's: a read that runs torch's intra-op threads is busy, and an error leans
    to "busy", which keeps the CPU-sized plan. The time the reading thread waited for a CPU (Linux's schedstat) is
    left out of the wall time: on a machine busy with other work, reads that use the CPU are not mistaken for reads
    that wait (measured: a 0.2 s CPU-bound loop among 4 on 2 cores took 0.57 s, 0.37 s of it queued for a CPU), nor
    sleeping reads, which queue after waking, for busy ones. The reads see the global RNGs (`random`, numpy, torch)
    seeded with 0; the caller's are left as they were. None when there is nothing to read, any read fails or none
    began before the deadline: no decision, and a failure is left for the loader to report at its batch.
    """
    if length < 1:
        return None
    indices = [k * length // (reads + 1) for k in range(reads + 1)]
    timed = time_reads(dataset, indices[0], indices[1:] if length > 1 else indices, budget_s=budget_s,
                       deadline_s=deadline_s, measure=_bytes, fork=fork)
    if timed is None:
        return None
    cut = timed.cut_off
    if cut is None:
        return ReadProbe(timed.reads, timed.wall_s, timed.cpu_s, timed.sample_bytes, timed.queued_s)
    return ReadProbe(timed.reads, timed.wall_s + cut.wall_s, timed.cpu_s + cut.cpu_s, timed.sample_bytes,
                     timed.queued_s + cut.queued_s, cut)


def _bytes(sample: Any) -> int | None:
    """The bytes of a sample's tensors and arrays (nested in tuples, lists and dicts; numbers count as nothing);
    None when it holds something else (an image object, a string), whose batched size is not known."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if isinstance(sample, np.ndarray):
        return int(sample.nbytes)
    if isinstance(sample, (bool, int, float)):
        return 0
    parts: Sequence[Any] | None = None
    if isinstance(sample, (tuple, list)):
        parts = sample
    elif isinstance(sample, dict):
        parts = list(sample.values())
    if not parts:
        return None
    sizes = [_bytes(p) for p in parts]
    return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)


@dataclass(frozen=True)
class PoolSize:
    """Loader threads for waiting reads: `threads` to start with, growing to at most `most`, and why."""

    threads: int
    most: int
    reasons: tuple[str, ...]


def size_pool(probe: ReadProbe, *, batch_size: int, cores: int, prefetch_factor: int,
              available_bytes: int | None) -> PoolSize:
    """Threads for reads that wait, from Little's law: batches in flight = the rate wanted x a batch's time.

    The rate wanted is the most the loader's `cores` could make if no read waited, `cores / (batch x CPU a read)`
    batches/s; a batch takes `batch x wall a read` in one thread, so the pool is `cores / busy` threads: as many
    as keep the cores busy, never fewer than `cores`. At most `MAX_THREADS`, and at most what keeps
    `threads x prefetch_factor` batches within `MEMORY_SHARE` of the `available_bytes` when the sample's size is
    known. `PoolGrowth` adds threads later where the training still waits.
    """
    most, memory = MAX_THREADS, ""
    batch_bytes = probe.sample_bytes * batch_size if probe.sample_bytes else None
    if batch_bytes and available_bytes:
        fits = int(available_bytes * MEMORY_SHARE) // (batch_bytes * prefetch_factor)
        if fits < most:
            most = max(cores, fits)
            memory = (f" (the batches in flight within {MEMORY_SHARE:.1%} of the {format_bytes(available_bytes)} of "
                      "memory available)")
    needed = math.ceil(cores / probe.busy) if probe.busy > 0 else most
    threads = min(most, max(cores, needed))
    in_flight = threads * prefetch_factor
    size = f", ~{format_bytes(in_flight * batch_bytes)} at {format_bytes(batch_bytes)} a batch" if batch_bytes else ""
    grows = threads < most
    reasons = [
        f"num_workers={threads}: reads wait ({probe.describe()}), so threads overlap them; Little's law: the rate "
        f"{cores} core(s) can make x a batch's wall time = {cores} / {probe.busy:.2f} busy = {needed}, at most {most}"
        f"{memory}",
        f"prefetch_factor={prefetch_factor} ({in_flight} batches in flight{size}"
        + (f"; {most * prefetch_factor} at most as the pool grows)" if grows else ")")]
    if grows:
        reasons.append(f"the pool grows to at most {most} threads while the training waits for batches more than "
                       f"{WAIT_SHARE:.0%} of its time and threads x busy stays within {cores} core(s)")
    return PoolSize(threads, most, tuple(reasons))


class PoolGrowth:
    """When a `ThreadLoader`'s pool should grow: the training waited for batches more than `WAIT_SHARE` of a window
    (at least `window_s` and `WINDOW_BATCHES` batches) and the pool's CPU (threads x busy) has room in `cores`;
    here a fetch's time queued for a CPU counts as busy: threads that queue for the CPU are limited by it.
    The new size is Little's law on the window: the training's own rate x a batch's fetch time, with `HEADROOM`;
    at least one thread more, at most `most` and what `cores` allow at the measured busy share."""

    def __init__(self, most: int, cores: int, *, window_s: float = WINDOW_S) -> None:
        self.most, self.cores, self.window_s = most, cores, window_s
        self._start: float | None = None
        self._waited, self._taken = 0.0, 0
        self._stats: FetchStats | None = None

    def restart(self) -> None:
        """Forget the current window (an epoch's first batch waits for the pipeline to fill, whatever its size)."""
        self._start = None

    def taken(self, waited_s: float, stats: FetchStats) -> int | None:
        """A batch was taken after waiting `waited_s` for it; the new pool size when it should grow, else None."""
        now = time.perf_counter()
        if self._start is None or self._stats is None:
            self._start, self._waited, self._taken, self._stats = now, 0.0, 0, stats
            return None
        self._waited += waited_s
        self._taken += 1
        elapsed = now - self._start
        if elapsed < self.window_s or self._taken < WINDOW_BATCHES:
            return None
        before, waited, taken = self._stats, self._waited, self._taken
        self._start, self._waited, self._taken, self._stats = now, 0.0, 0, stats
        fetched, wall = stats.batches - before.batches, stats.wall_s - before.wall_s
        if stats.threads >= self.most or waited <= WAIT_SHARE * elapsed or fetched < 1 or wall <= 0:
            return None
        busy = (stats.cpu_s - before.cpu_s + stats.queued_s - before.queued_s) / wall
        own_s = max(elapsed - waited, 1e-6) / taken  # the training's time per batch, its waits left out
        wanted = math.ceil(HEADROOM * (wall / fetched) / own_s)
        room = math.floor(self.cores / busy) if busy > 0 else self.most
        grown = min(self.most, room, max(stats.threads + 1, wanted))
        return grown if grown > stats.threads else None
