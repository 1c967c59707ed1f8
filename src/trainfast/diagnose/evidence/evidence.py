"""The evidence the verdict and the fixes are computed from (`Evidence`: frozen, plain data), made from a run's
capture alone (`evidence_of`): the step's split, what the hooks saw the script use, how the loader's workers spent
their time, steps slow at a period, how busy the GPU was, the MFU, a whole run's accounting."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainfast.diagnose.evidence import monitored, noise
from trainfast.diagnose.evidence.comms import Collectives
from trainfast.diagnose.evidence.periodic import Periodic, epoch_cost, periodic_steps
from trainfast.diagnose.evidence.wholerun import RunEvidence, run_evidence, whole_entry
from trainfast.diagnose.evidence.workers import WorkerTime, of_training
from trainfast.diagnose.records.capture import Capture
from trainfast.diagnose.records.steps import Fractions, LoaderStats, StepRecord
from trainfast.diagnose.records.trials import Trials
from trainfast.flops import utilisation
from trainfast.monitor import percentile


@dataclass(frozen=True)
class Evidence:
    """Everything measured or observed about a run that the verdict or a fix may cite (evidence_of: from a capture)."""

    verdict: str  # set once the verdict is known (verdict.py): some fixes depend on it
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
    compute_s: float = 0.0  # median measured compute per step
    # mean measured step: the loop's rate where batches arrive in bursts (waiting workers deliver several at once,
    # then none), whose median step is a short one
    step_mean_s: float = 0.0
    # the candidate fixes timed on the script's own model (capture/probe.py); None when no replay was tried
    trials: Trials | None = None
    parameter_dtypes: frozenset[str] = frozenset()  # floating dtypes of the trained parameters
    cycle: str | None = None  # "whole"/"partial": the loop collects between updates (timeline.py)
    collectives: Collectives | None = None  # the collectives across ranks over the measured steps; None: none seen
    workers: WorkerTime | None = None  # how the training loader's workers spent the measured steps (workers.py)
    # steps slow at a period (periodic.py): each epoch's first, or every N-th; None: none stood out
    periodic: Periodic | None = None
    # what the epoch starts in the measured window cost (periodic.py `epoch_cost`), standing out or not; None with
    # fewer than 2 of them there
    epoch_cost: Periodic | None = None
    epoch_starts: tuple[int, ...] = ()  # the measured steps in which a training loader's new epoch began
    # how busy the GPU was over the measured steps: NVML's utilisation (%) of the GPUs this process used, else the
    # CUDA events' share of the steps' wall time (x 100); None without either
    gpu_util: float | None = None
    gpu_util_devices: tuple[str, ...] = ()  # the NVML GPUs that figure is over
    device_busy: float | None = None  # the CUDA events' share
    intervals: Mapping[str, tuple[float, float]] | None = None  # each part's share over the steps (noise.py)
    compute: Mapping[str, object] | None = None  # FLOPs, the peak and MFU (`compute_of`: the report's entry)
    run: RunEvidence | None = None  # a whole run's accounting (wholerun.py)
    script_args: tuple[str, ...] = ()  # the script's command line, as it was run (its own settings, for the fixes)

    @property
    def conv_weights_nchw(self) -> int:
        """Conv weights unambiguously NCHW: the ones channels_last would change."""
        return self.conv_weights - self.conv_weights_channels_last - self.conv_weights_ambiguous

    @property
    def scaler_skip_fraction(self) -> float | None:
        """Share of the GradScaler's optimizer steps it skipped; None without a GradScaler."""
        return self.scaler_skipped_steps / self.scaler_steps if self.scaler_steps else None


def evidence_of(capture: Capture) -> Evidence:
    """What the verdict and the rules read, from the measured steps and what the hooks and the monitor observed."""
    t, o, machine = capture.timeline, capture.observed, capture.machine
    records = t.records
    monitor = capture.monitor
    gpu_util, gpu_util_devices = monitored.gpu_util(monitor, t, o.device_index if o.device == "cuda" else None)
    device_busy = _device_busy(capture)
    if gpu_util is None and device_busy is not None:  # without NVML, CUDA events say how busy the GPU was
        gpu_util = 100 * device_busy
    total = sum(r.total_s for r in records)
    fractions = Fractions.of(total_s=total, wait_s=sum(r.wait_s for r in records),
                             transfer_s=sum(r.transfer_s for r in records), host_s=sum(r.host_s for r in records),
                             collect_s=sum(r.collect_s for r in records), comm_s=sum(r.comm_s for r in records))
    waits = [r.wait_s for r in records]
    mean_wait = statistics.fmean(waits) if waits else 0.0
    return Evidence(
        verdict="", device=o.device, fractions=fractions,
        step_s=statistics.median(r.total_s for r in records) if records else 0.0, steps=len(records),
        samples_per_s=t.samples_per_s,
        syncs_per_step=statistics.fmean(r.syncs for r in records) if records else 0.0, cpus=machine.cpus,
        threads=o.threads, loaders=capture.loaders, shm_bytes=(capture.env or {}).get("shm_bytes"),
        autocast=o.autocast, scaler_steps=o.scaler_steps, scaler_skipped_steps=o.scaler_skipped_steps,
        bf16_supported=machine.bf16_native, compiled=o.compiled, recompiled_frames=o.recompiled_frames,
        graph_breaks=o.graph_breaks, conv_weights=o.conv_weights,
        conv_weights_channels_last=o.conv_weights_channels_last, conv_weights_ambiguous=o.conv_weights_ambiguous,
        input_layout=o.input_layout, cudnn_benchmark=machine.cudnn_benchmark,
        gpu_memory_fraction=o.gpu_memory_fraction, jpeg_decoded_pixels=o.jpeg_decoded_pixels,
        wait_spike_ratio=percentile(waits, 95) / mean_wait if mean_wait > 0 else None,
        worker_private_growth_per_min=monitored.worker_private_growth(monitor, t.measure_started_monotonic,
                                                                      t.measure_ended_monotonic),
        loader_headroom=capture.loader_headroom,
        thread_probe=o.trials.thread_probe() if o.trials is not None else None,
        input_source=t.input_source,
        compute_s=statistics.median(r.compute_s for r in records) if records else 0.0,
        step_mean_s=total / len(records) if records else 0.0,
        trials=o.trials, parameter_dtypes=frozenset(o.parameter_dtypes), cycle=t.cycle,
        collectives=Collectives.of(o.collectives),
        workers=of_training(capture.loaders, monitor, t.measure_started_monotonic,
                            t.measure_ended_monotonic, o.worker_window),
        periodic=periodic_steps(records, t.epoch_starts, t.step_marks, t.left_out),
        epoch_cost=epoch_cost(records, t.epoch_starts),
        epoch_starts=t.epoch_starts, gpu_util=gpu_util, gpu_util_devices=tuple(gpu_util_devices),
        device_busy=device_busy, intervals=noise.intervals(list(records)), compute=compute_of(capture),
        run=_run(capture, records), script_args=tuple(str(a) for a in (capture.script or {}).get("args") or ()))


def compute_of(capture: Capture) -> dict[str, Any] | None:
    """The report's `compute` entry: the counted step's FLOPs over the mean measured step, against the peak."""
    records, o = capture.timeline.records, capture.observed
    if not records:
        return None
    if o.flops_per_step is None:
        return {"flops_per_step": None, "reason": o.flops_reason or "no step was counted"}
    if o.peak is None:
        return {"flops_per_step": o.flops_per_step, "reason": o.peak_error}
    step_s = statistics.fmean(r.total_s for r in records)
    return utilisation(o.flops_per_step, step_s, o.peak).to_json() | {"covers": COUNTED, "reason": None}


def _run(capture: Capture, records: Sequence[StepRecord]) -> RunEvidence | None:
    """A whole run's accounting, for the fixes of its phases."""
    entry = whole_entry(capture)
    if entry is None or capture.whole is None:
        return None
    return run_evidence(entry, loaders=capture.loaders, trial=capture.whole.trial, bandwidth=capture.whole.bandwidth,
                        step_wait_s=statistics.median(r.wait_s for r in records) if records else None)


def _device_busy(capture: Capture) -> float | None:
    """Share of the measured steps' wall time the GPU spent on their work (CUDA events; None without them)."""
    device_s, records = capture.observed.device_step_s, capture.timeline.records
    if not device_s or not records:
        return None
    host_s = sum(r.total_s for r in records[-len(device_s):])
    return min(1.0, sum(device_s) / host_s) if host_s > 0 else None


COUNTED = ("one whole training step after the measured ones, as the script ran it (matmuls, convolutions and "
           "attention at 2 FLOPs per multiply-add; elementwise ops and the optimizer count 0)")
