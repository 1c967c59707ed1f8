"""The evidence the verdict and the recommendations are computed from: plain data, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainfast.diagnose.classify import Fractions


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

    @property
    def thread_backed(self) -> bool:
        """trainfast's `ThreadLoader`: its workers are threads of the training process (diagnose/loaders.py)."""
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
                "image_hw": list(self.image_hw) if self.image_hw else None}


def main_loader(loaders: Sequence[LoaderStats]) -> LoaderStats | None:
    """The training loader the steps waited on most (validation loaders, fetched without gradients, excluded)."""
    training = [s for s in loaders if s.batches > s.evaluation_batches]
    return max(training, key=lambda s: s.wait_s, default=None)


@dataclass(frozen=True)
class Evidence:
    """Everything measured or observed about a run that a recommendation may cite."""

    verdict: str
    device: str  # "cpu" or "cuda"
    fractions: Fractions
    step_s: float  # median measured step
    steps: int
    samples_per_s: float | None
    syncs_per_step: float
    cpus: int
    threads: int = 1  # intra-op threads of the training process
    loaders: tuple[LoaderStats, ...] = ()
    shm_bytes: int | None = None
    autocast: tuple[tuple[str, str], ...] = ()  # (device, dtype) seen entered
    scaler_steps: int = 0  # optimizer steps taken through a GradScaler
    scaler_skipped_steps: int = 0  # of those, skipped for inf/NaN gradients (read for the report only: it syncs)
    bf16_supported: bool = False
    compiled: bool = False
    recompiled_frames: int = 0
    graph_breaks: int = 0
    conv_weights: int = 0
    conv_weights_channels_last: int = 0
    conv_weights_ambiguous: int = 0  # strides that fit both layouts (depthwise kernels): no evidence either way
    input_layout: str | None = None  # the model's first 4-D input: "channels_last" or "contiguous"
    cudnn_benchmark: bool = False
    gpu_memory_fraction: float | None = None  # peak allocated / total
    jpeg_decoded_pixels: float | None = None  # median pixels per decoded JPEG (main process)
    wait_spike_ratio: float | None = None  # p95 / median data wait per step
    loader_headroom: float | None = None  # loader replayed alone / training throughput (diagnose() measures it)
    worker_private_growth_per_min: float | None = None
    # (threads, compute time at that thread count / compute time as the script ran): measured on the CPU (a
    # replay of the model at that count, probe.py) before a loader fix that takes intra-op threads is proposed
    thread_probe: tuple[int, float] | None = None
    input_source: str | None = None  # "loader" or "script" (no DataLoader: input prepared in the loop)
    notes: tuple[str, ...] = field(default=())
    compute_s: float = 0.0  # median measured compute per step
    # mean measured step: the loop's rate where batches arrive in bursts (waiting workers deliver several at once,
    # then none), whose median step is a short one
    step_mean_s: float = 0.0
    # the candidate fixes timed on the script's own model (probe.py `Trials`); None when no replay was tried
    trials: Any = None
    parameter_dtypes: frozenset[str] = frozenset()  # floating dtypes of the trained parameters
    cycle: str | None = None  # "whole"/"partial": the loop collects between updates (timeline.py)
    # the collectives across ranks over the measured steps (comms.py `collectives_json`); None: none seen
    collectives: dict[str, Any] | None = None
    # how the training loader's workers spent the measured steps (workers.py `WorkerTime`); None: not measured
    workers: Any = None
    # steps slow at a period (periodic.py `Periodic`): each epoch's first, or every N-th; None: none stood out
    periodic: Any = None
    # what the epoch starts in the measured window cost (periodic.py `epoch_cost`), standing out or not; None with
    # fewer than 2 of them there
    epoch_cost: Any = None
    epoch_starts: tuple[int, ...] = ()  # the measured steps in which a training loader's new epoch began

    @property
    def conv_weights_nchw(self) -> int:
        """Conv weights unambiguously NCHW: the ones channels_last would change."""
        return self.conv_weights - self.conv_weights_channels_last - self.conv_weights_ambiguous

    @property
    def scaler_skip_fraction(self) -> float | None:
        """Share of the GradScaler's optimizer steps it skipped; None without a GradScaler."""
        return self.scaler_skipped_steps / self.scaler_steps if self.scaler_steps else None
