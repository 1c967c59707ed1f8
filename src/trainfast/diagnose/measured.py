"""The evidence the rules read, taken from a run: the measured steps, what the hooks observed and the monitor."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from trainfast.diagnose.classify import Fractions
from trainfast.diagnose.comms import collectives_json
from trainfast.diagnose.evidence import Evidence
from trainfast.diagnose.instrument import Instrumentation, Observations
from trainfast.diagnose.monitored import worker_private_growth
from trainfast.diagnose.periodic import epoch_cost, periodic_steps
from trainfast.diagnose.timeline import StepRecord, Timeline
from trainfast.diagnose.worker_clock import WorkerTotals
from trainfast.diagnose.workers import of_training
from trainfast.dynamo import dynamo_counts
from trainfast.host import available_cpus
from trainfast.monitor import Monitor, percentile
from trainfast.precision.policy import device_caps


def evidence_of(timeline: Timeline, instrumentation: Instrumentation, records: list[StepRecord], *,
                final: bool = False, verdict: str = "", env: dict[str, Any] | None = None,
                monitor: Monitor | None = None, loader_headroom: float | None = None) -> Evidence:
    """What the rules read, from the measured steps and what the hooks observed. `final`: for the report, when
    the figures that synchronise the device (skipped scaler steps, peak memory) may be read."""
    observed = instrumentation.observed
    total = sum(r.total_s for r in records)
    fractions = Fractions.of(total_s=total, wait_s=sum(r.wait_s for r in records),
                             transfer_s=sum(r.transfer_s for r in records), host_s=sum(r.host_s for r in records),
                             collect_s=sum(r.collect_s for r in records), comm_s=sum(r.comm_s for r in records))
    device = device_of(observed)
    waits = [r.wait_s for r in records]
    mean_wait = statistics.fmean(waits) if waits else 0.0
    compiled, recompiled, breaks = _compile_counts(observed)
    decoded = float(statistics.median(observed.jpeg_decoded_pixels)) if observed.jpeg_decoded_pixels else None
    return Evidence(
        verdict=verdict, device=device, fractions=fractions,
        step_s=statistics.median(r.total_s for r in records) if records else 0.0, steps=len(records),
        samples_per_s=timeline.samples_per_s,
        syncs_per_step=statistics.fmean(r.syncs for r in records) if records else 0.0, cpus=available_cpus(),
        threads=observed.threads or torch.get_num_threads(), loaders=tuple(instrumentation.loaders),
        shm_bytes=(env or {}).get("shm_bytes"), autocast=tuple(sorted(observed.autocast)),
        scaler_steps=observed.scaler_steps, scaler_skipped_steps=observed.scaler_skipped() if final else 0,
        bf16_supported=bf16_native(device, observed.device_index),
        compiled=compiled, recompiled_frames=recompiled, graph_breaks=breaks, conv_weights=observed.conv_weights,
        conv_weights_channels_last=observed.conv_weights_channels_last,
        conv_weights_ambiguous=observed.conv_weights_ambiguous, input_layout=observed.input_layout,
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        gpu_memory_fraction=_gpu_memory_fraction(device, observed.device_index) if final else None,
        jpeg_decoded_pixels=decoded,
        wait_spike_ratio=percentile(waits, 95) / mean_wait if mean_wait > 0 else None,
        worker_private_growth_per_min=worker_private_growth(monitor, timeline.measure_started_monotonic),
        loader_headroom=loader_headroom,
        thread_probe=observed.trials.thread_probe() if observed.trials is not None else None,
        input_source=timeline.input_source,
        compute_s=statistics.median(r.compute_s for r in records) if records else 0.0,
        step_mean_s=total / len(records) if records else 0.0,
        trials=observed.trials, parameter_dtypes=frozenset(observed.parameter_dtypes), cycle=timeline.cycle,
        collectives=collectives_json(observed.comm_at_warmup, observed.comm_at_end, instrumentation.collectives),
        workers=of_training(instrumentation.loaders, monitor, timeline.measure_started_monotonic,
                            timeline.measure_ended_monotonic, _clock_window(observed)),
        periodic=periodic_steps(records, timeline.epoch_starts), epoch_cost=epoch_cost(records, timeline.epoch_starts),
        epoch_starts=tuple(timeline.epoch_starts))


def _clock_window(observed: Observations) -> WorkerTotals | None:
    """The worker processes' own account of their batches over the measured steps (worker_clock.py)."""
    start, end = observed.workers_at_warmup, observed.workers_at_end
    return end.since(start) if start is not None and end is not None else None


def device_of(observed: Observations) -> str:
    """The model's device type; without a model seen, "cuda" only if the process did CUDA work (asking the
    device anything on a CPU-only run would create a CUDA context)."""
    return observed.device or ("cuda" if torch.cuda.is_initialized() else "cpu")


def _compile_counts(observed: Observations) -> tuple[bool, int, int]:
    """(compiled, frames recompiled, graph breaks) of this run: torch._dynamo's counters are process-wide, so
    the loop compiled if frames were compiled since instrumentation started (or its model is compiled, cached
    from before); recompiles are what the measured steps added (warm-up end to their end), graph breaks what
    this loop's compilation found (a break, usually found in warm-up, costs eager time at every step)."""
    now = dynamo_counts()
    start = observed.dynamo_at_start or now
    warm, end = observed.dynamo_at_warmup or now, observed.dynamo_at_end or now
    compiled = observed.compiled_model or now["frames"] > start["frames"]
    return (compiled, max(0, end["frames"] - warm["frames"]), max(0, end["graph_breaks"] - start["graph_breaks"]))


def bf16_native(device: str, index: int | None) -> bool:
    """bf16 runs natively on the model's GPU (compute capability 8.0, Ampere, and later; the current device may
    be another one) or on this CPU (AMX, AVX512-BF16, ARM BF16)."""
    if device == "cpu":
        return device_caps(torch.device("cpu")).bf16
    return device == "cuda" and torch.cuda.get_device_capability(index) >= (8, 0)


def _gpu_memory_fraction(device: str, index: int | None) -> float | None:
    """Peak memory allocated on the model's GPU (None: the current one) over its total."""
    if device != "cuda":
        return None
    total = torch.cuda.get_device_properties(index).total_memory
    return torch.cuda.max_memory_allocated(index) / total if total else None


def device_busy(instrumentation: Instrumentation, records: list[StepRecord]) -> float | None:
    """Share of the measured steps' wall time the GPU spent on their work (CUDA events; None without them)."""
    events = instrumentation.device_timer
    if not events.pairs or not records:
        return None
    device_s = events.step_seconds()
    host_s = sum(r.total_s for r in records[-len(device_s):])
    return min(1.0, sum(device_s) / host_s) if host_s > 0 else None
