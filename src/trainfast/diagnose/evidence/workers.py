"""How the loader's workers spent the measured steps: computing, queued for a core, or waiting on something else
(a read from storage, a network round trip). Waiting workers need concurrency, not cores: the fix for them is
more workers than cores (Little's law), where busy ones are capped by the cores.

Worker processes time their own batches (CPU, run-queue and wall time inside each fetch: worker_clock.py), which
tells a worker that waits on a read from one idle for want of the next index; where they could not (workers
started by spawn or forkserver), the OS's per-process figures over the measured window stand in (the monitor's
`workers.cpu_percent` and `workers.queued_percent`), idle time counted as waiting. A loader made of threads
(trainfast's `ThreadLoader`) times its batches itself; without workers, the doctor times the main thread's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainfast.diagnose.evidence.monitored import since_start
from trainfast.diagnose.records.steps import LoaderStats, WorkerTotals, main_loader
from trainfast.host import QUEUE_KNOWN
from trainfast.monitor.series import Series

# Workers busy on a core (or queued for one) less than half their time mostly wait: each needs at most half a
# core, so more of them than cores still fit, and the time a batch takes is mostly latency to overlap.
WAITING_BUSY = 0.5


# Samples of the monitor (0.5 s apart) inside the measured window before its worker figures are read: one sample
# can straddle the warm-up's worker start.
MIN_SAMPLES = 2


@dataclass(frozen=True)
class WorkerTime:
    """Shares of the loader workers' wall time: `busy` on a core, `queued` runnable but waiting for one (None where
    the OS does not say), the rest waiting on something else. `source`: where the figures come from."""

    busy: float
    queued: float | None
    workers: float  # mean number of workers alive while measuring
    source: str
    who: str = "the workers"  # who made the batches, for the phrase
    batch_s: float | None = None  # the time a batch takes inside a worker, measured there (None: not measured)

    @property
    def waiting(self) -> float:
        return max(0.0, 1.0 - self.busy - (self.queued or 0.0))

    @property
    def wait(self) -> bool:
        """The workers mostly wait on something other than a core."""
        return self.busy + (self.queued or 0.0) < WAITING_BUSY

    def phrase(self) -> str:
        """What the workers did, for the verdict: "the workers wait on reads (busy 12 % of the time)"."""
        busy = f"busy {self.busy:.0%}"
        if self.wait:
            return f"{self.who} wait on reads or other I/O ({busy} of the time, {self.waiting:.0%} waiting)"
        if self.queued is not None and self.queued >= self.busy:
            return f"{self.who} wait for a core ({busy} of the time, queued for a core {self.queued:.0%})"
        return f"{self.who} are busy making batches (decoding, transforms: {busy} of the time on a core)"

    def to_json(self) -> dict[str, Any]:
        return {"who": self.who, "busy": round(self.busy, 4),
                "queued": None if self.queued is None else round(self.queued, 4), "waiting": round(self.waiting, 4),
                "workers": round(self.workers, 2), "wait": self.wait,
                "batch_s": None if self.batch_s is None else round(self.batch_s, 6), "source": self.source}


def of_training(loaders: Sequence[LoaderStats], monitor: Series | None, measuring_from: float | None,
                measuring_until: float | None, clock: WorkerTotals | None = None) -> WorkerTime | None:
    """How the training loader's batches were made: by its threads or the main thread when the doctor saw them
    made; by worker processes as they timed their batches themselves (`clock`: over the measured window); else
    as the OS accounts for the worker processes."""
    loader = main_loader(loaders)
    if loader is None:
        return None
    if loader.fetch_wall_s > 0:
        return from_loader(loader)
    if clock is not None and clock.batches > 0 and clock.wall_s > 0 and loader.num_workers:
        return from_clock(clock, loader.num_workers)
    return from_monitor(monitor, measuring_from, measuring_until)


def from_clock(clock: WorkerTotals, workers: int) -> WorkerTime:
    """The worker processes' own account of the batches they made while measuring (worker_clock.py)."""
    return WorkerTime(busy=min(1.0, clock.cpu_s / clock.wall_s),
                      queued=None if clock.queued_s is None else min(1.0, clock.queued_s / clock.wall_s),
                      workers=float(workers), batch_s=clock.wall_s / clock.batches,
                      source="the workers themselves: CPU time" + (" and run-queue delay" if clock.queued_s is not None
                                                                    else "")
                             + f" over wall time inside the {clock.batches} batch(es) they made while measuring")


def from_monitor(monitor: Series | None, measuring_from: float | None, measuring_until: float | None
                 ) -> WorkerTime | None:
    """The worker processes' shares over the measured window, from the monitor's samples (None: no worker
    process alive in enough samples, or no monitor)."""
    since, until = since_start(monitor, measuring_from), since_start(monitor, measuring_until)
    if monitor is None or since is None or "workers.cpu_percent" not in monitor.metrics():
        return None
    counts = dict(zip(*monitor.series("workers.count"), strict=True))
    cpu = dict(zip(*monitor.series("workers.cpu_percent"), strict=True))
    queued = dict(zip(*monitor.series("workers.queued_percent"), strict=True)) \
        if "workers.queued_percent" in monitor.metrics() else {}
    # a sample covers the interval before it: the first one inside the window may hold the time before it
    times = [t for t in sorted(counts) if since < t and (until is None or t <= until) and counts[t] > 0]
    if len(times) < MIN_SAMPLES:
        return None
    alive = sum(counts[t] for t in times)
    with_queue = all(t in queued for t in times)
    return WorkerTime(busy=min(1.0, sum(cpu.get(t, 0.0) for t in times) / (100 * alive)),
                      queued=min(1.0, sum(queued[t] for t in times) / (100 * alive)) if with_queue else None,
                      workers=alive / len(times),
                      source="the OS: each worker process's CPU time" + (" and run-queue delay" if with_queue else "")
                             + " over the measured steps' wall time")


def from_loader(loader: LoaderStats) -> WorkerTime | None:
    """The shares of a loader whose batches the doctor saw made: in the main thread (no workers: its CPU time while
    fetching, timed on a sample of the batches), or by trainfast's `ThreadLoader` threads (their own CPU, run-queue
    and wall time inside each batch). None for worker processes (see `from_clock`)."""
    if loader.fetch_wall_s <= 0:
        return None
    threads = loader.num_workers if loader.thread_backed else 0
    where = (f"the loader's {threads} thread(s)' CPU time and run-queue delay over wall time inside their batches"
             if threads else
             "the main thread's CPU time and run-queue delay over wall time while it made the batches (no workers)")
    queued = min(1.0, loader.fetch_queued_s / loader.fetch_wall_s) if QUEUE_KNOWN else None
    return WorkerTime(busy=min(1.0, loader.fetch_cpu_s / loader.fetch_wall_s), queued=queued,
                      workers=float(max(1, threads)), source=where,
                      batch_s=loader.fetch_wall_s / loader.fetch_batches if loader.fetch_batches else None,
                      who="the loader's threads" if threads else "the batches' reads in the main thread")
