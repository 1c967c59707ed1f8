"""The measured steps and loaders, and the step's split into parts: the records capture hands on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class StepRecord:
    end_s: float  # seconds since the timeline started
    total_s: float
    wait_s: float
    transfer_s: float
    host_s: float
    samples: int
    syncs: int
    collect_s: float = 0.0  # a collection phase before the step's update (module doc)
    comm_s: float = 0.0  # exposed communication: blocked in collectives (module doc)

    @property
    def compute_s(self) -> float:
        return max(0.0, self.total_s - self.wait_s - self.transfer_s - self.host_s - self.collect_s - self.comm_s)


# What a measured step was seen to do besides training (`TimelineRecord.step_marks`): a period of slow steps is named
# by them (periodic.py). Epoch starts are marked on their own (`epoch_starts`).
SAVE, LOG, EVALUATION = "a checkpoint save", "a print or log", "an evaluation forward"
MARKS = (SAVE, EVALUATION, LOG)


PARTS = ("data_wait", "transfer", "host", "collection", "communication")


@dataclass(frozen=True)
class Fractions:
    """Shares of step wall time; they sum to 1."""

    data_wait: float
    transfer: float
    host: float
    compute: float
    collection: float = 0.0  # a collection phase between updates (RL rollouts: timeline.py)
    communication: float = 0.0  # blocked in collectives across ranks (exposed communication: comms.py)

    @classmethod
    def of(cls, *, total_s: float, wait_s: float, transfer_s: float, host_s: float,
           collect_s: float = 0.0, comm_s: float = 0.0) -> Fractions:
        if total_s <= 0:
            return cls(0.0, 0.0, 0.0, 0.0)
        wait, transfer, host, collect = wait_s / total_s, transfer_s / total_s, host_s / total_s, collect_s / total_s
        comm = comm_s / total_s
        return cls(wait, transfer, host, max(0.0, 1.0 - wait - transfer - host - collect - comm), collect, comm)

    def share(self, part: str) -> float:
        return float(getattr(self, part))

    def to_json(self) -> dict[str, float]:
        return {"data_wait": self.data_wait, "transfer": self.transfer, "host": self.host, "compute": self.compute,
                "collection": self.collection, "communication": self.communication}


def max_speedup(share: float) -> float:
    """The whole step's gain if a part taking `share` of it took no time at all (Amdahl's bound)."""
    return 1.0 / max(1.0 - share, 1e-3)


def max_speedups(f: Fractions) -> dict[str, float]:
    return {part: max_speedup(f.share(part)) for part in PARTS}


@dataclass
class LoaderStats:
    """One loader seen while measuring: its settings and what it cost."""

    index: int
    kind: str
    dataset: str
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    batch_size: int | None
    in_memory: bool
    decode: str | None  # trainfast ImageFolder's decode mode, when that is the dataset
    batches_per_epoch: int | None = None
    batches: int = 0
    evaluation_batches: int = 0  # fetched with gradients off: validation, not training
    wait_s: float = 0.0
    # CPU and wall time inside the batches where the doctor can see them: made in the main thread (no workers), or
    # by a thread-backed loader's threads (its `fetch_stats`); 0 for worker processes (the OS says: workers.py)
    fetch_cpu_s: float = 0.0
    fetch_wall_s: float = 0.0
    fetch_queued_s: float = 0.0  # of it, ready to run but waiting for a core (Linux)
    fetch_batches: int = 0  # the batches those figures cover
    epochs: int = 0
    startup_s: list[float] = field(default_factory=list)  # iter() to first batch, per epoch
    batch_bytes: int | None = None
    image_hw: tuple[int, int] | None = None
    # attributes of the dataset the loop set after the loader's first iterator started (capture/dataset_watch.py):
    # worker processes hold a copy made when they start, which never sees them
    dataset_set_after_start: list[str] = field(default_factory=list)

    @property
    def thread_backed(self) -> bool:
        """trainfast's `ThreadLoader`: its workers are threads of the training process (capture/loader_hook.py)."""
        return self.kind.startswith("trainfast ThreadLoader")

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "dataset": self.dataset, "num_workers": self.num_workers,
                "pin_memory": self.pin_memory, "persistent_workers": self.persistent_workers,
                "prefetch_factor": self.prefetch_factor, "batch_size": self.batch_size, "in_memory": self.in_memory,
                "decode": self.decode, "batches_per_epoch": self.batches_per_epoch, "batches": self.batches,
                "evaluation_batches": self.evaluation_batches,
                "wait_s": self.wait_s, "fetch_cpu_s": self.fetch_cpu_s,
                "fetch_wall_s": self.fetch_wall_s, "fetch_queued_s": self.fetch_queued_s,
                "fetch_batches": self.fetch_batches, "epochs": self.epochs,
                "startup_s": list(self.startup_s), "batch_bytes": self.batch_bytes,
                "image_hw": list(self.image_hw) if self.image_hw else None,
                "dataset_set_after_start": list(self.dataset_set_after_start)}


def main_loader(loaders: Sequence[LoaderStats]) -> LoaderStats | None:
    """The training loader the steps waited on most (validation loaders, fetched without gradients, excluded)."""
    training = [s for s in loaders if s.batches > s.evaluation_batches]
    return max(training, key=lambda s: s.wait_s, default=None)


class WorkerTotals(NamedTuple):
    """Sums over every worker's batches so far."""

    batches: int
    wall_s: float
    cpu_s: float
    queued_s: float | None  # None where the kernel keeps no schedstat
    workers: int  # worker processes that recorded a batch

    def since(self, before: WorkerTotals) -> WorkerTotals:
        queued = (self.queued_s - before.queued_s if self.queued_s is not None and before.queued_s is not None
                  else None)
        return WorkerTotals(self.batches - before.batches, self.wall_s - before.wall_s, self.cpu_s - before.cpu_s,
                            queued, self.workers)
