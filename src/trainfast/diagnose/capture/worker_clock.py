"""`WorkerClock`: each loader worker process times its own batches from inside (wall time, CPU time, and the time
it was runnable but waiting for a core), into memory its parent shares, so the doctor knows how long a batch takes
inside a worker and whether that time is work or waiting (on storage, a network) — which the OS's per-process
figures alone cannot tell from a worker sitting idle for want of the next index.

The memory is an anonymous shared map made before the workers fork: they inherit it (and the patched fetchers,
instrument.py). Workers started by spawn or forkserver import torch afresh, without the patch: they record
nothing, and the doctor falls back on the OS's figures (workers.py). Each worker writes only its own slot, found
from its pid; the parent sums the slots at the measured window's two ends.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

from trainfast.diagnose.records.steps import WorkerTotals
from trainfast.host import QUEUE_KNOWN, queued_s

SLOTS = 4096  # one per worker process ever started while the doctor runs (slots of exited workers are kept)


_FIELDS = 5  # pid, batches, wall ns, CPU ns, run-queue ns


_PROBES = 16  # slots tried from pid % SLOTS before a worker gives up recording


class WorkerClock:
    """The shared slots, and the per-batch `timed` call a worker makes around its fetch."""

    def __init__(self) -> None:
        # MAP_SHARED | MAP_ANONYMOUS: a forked child writes into the same pages the parent reads
        self._map = mmap.mmap(-1, SLOTS * _FIELDS * 8)
        self._slots = np.frombuffer(self._map, dtype=np.int64).reshape(SLOTS, _FIELDS)
        self._mine: tuple[int, int] | None = None  # (pid, slot) of this process once it claimed one

    def _slot(self) -> int | None:
        pid = os.getpid()
        if self._mine is not None and self._mine[0] == pid:
            return self._mine[1]
        slots = self._slots
        for probe in range(_PROBES):
            slot = (pid + probe) % SLOTS
            if slots[slot, 0] in (0, pid):  # free (a race with another new worker needs pids 4096 apart)
                slots[slot] = (pid, 0, 0, 0, 0)
                self._mine = (pid, slot)
                return slot
        return None

    def record(self, wall_ns: int, cpu_ns: int, queued_ns: int) -> None:
        """Add one batch's figures to this worker's slot."""
        slot = self._slot()
        if slot is not None:
            self._slots[slot, 1:] += (1, wall_ns, cpu_ns, max(0, queued_ns))

    def timed(self) -> _Timing:
        """`with clock.timed(): fetch()` in a worker."""
        return _Timing(self)

    def totals(self) -> WorkerTotals:
        used = self._slots[self._slots[:, 0] != 0]
        sums = used[:, 1:].sum(axis=0) if len(used) else np.zeros(_FIELDS - 1, dtype=np.int64)
        return WorkerTotals(int(sums[0]), int(sums[1]) / 1e9, int(sums[2]) / 1e9,
                            int(sums[3]) / 1e9 if QUEUE_KNOWN else None, int((used[:, 1] > 0).sum()))

    def close(self) -> None:
        del self._slots  # (the array holds a view of the map)
        self._map.close()


class _Timing:
    __slots__ = ("_clock", "_cpu", "_queued", "_wall")

    def __init__(self, clock: WorkerClock) -> None:
        self._clock = clock

    def __enter__(self) -> None:
        self._queued = queued_s()
        self._wall, self._cpu = time.perf_counter_ns(), time.process_time_ns()

    def __exit__(self, *exc: object) -> None:
        wall, cpu = time.perf_counter_ns() - self._wall, time.process_time_ns() - self._cpu
        self._clock.record(wall, cpu, round((queued_s() - self._queued) * 1e9))
