"""What the hooks observed and what the machine says, resolved once, when the run is captured
(`Instrumentation.snapshot`): the compile counters' differences, the workers' window, the collectives' figures, the
matmul peak MFU is measured against, bf16 on the model's device, the peak GPU memory; after this nothing reads the
machine again."""

from __future__ import annotations

import socket
import statistics

import psutil
import torch

from trainfast.diagnose.capture.comms import Collectives, collectives_json
from trainfast.diagnose.capture.devicetime import DeviceTimer
from trainfast.diagnose.capture.observations import Observations
from trainfast.diagnose.records.capture import MachineRecord, ObservedRecord
from trainfast.dynamo import dynamo_counts
from trainfast.flops import Peak, peak_flops
from trainfast.host import available_cpus
from trainfast.precision.policy import device_caps


def machine_record(observed: Observations, device: str) -> MachineRecord:
    return MachineRecord(cpus=available_cpus(), logical_cpus=psutil.cpu_count() or 1,
                         bf16_native=bf16_native(device, observed.device_index),
                         cudnn_benchmark=bool(torch.backends.cudnn.benchmark), host=socket.gethostname())


def observed_record(observed: Observations, timer: DeviceTimer, collectives: Collectives, *, device: str,
                    measured: bool, final: bool) -> ObservedRecord:
    """What the hooks observed, resolved: the compile counters' differences, the workers' window, the matmul peak,
    and, in a final record, what synchronises the device (the skipped steps, the events, the peak memory)."""
    compiled, recompiled, breaks = _compile_counts(observed)
    start, end = observed.workers_at_warmup, observed.workers_at_end
    peak, peak_error = _peak(observed, device) if final and measured and observed.flops_per_step is not None \
        else (None, None)
    return ObservedRecord(
        device=device, device_index=observed.device_index, threads_seen=observed.threads,
        threads=observed.threads or torch.get_num_threads(), parameters=observed.parameters,
        parameter_dtypes=tuple(sorted(observed.parameter_dtypes)), autocast=tuple(sorted(observed.autocast)),
        compiled=compiled, recompiled_frames=recompiled, graph_breaks=breaks, conv_weights=observed.conv_weights,
        conv_weights_channels_last=observed.conv_weights_channels_last,
        conv_weights_ambiguous=observed.conv_weights_ambiguous, input_layout=observed.input_layout,
        scaler_steps=observed.scaler_steps, scaler_skipped_steps=observed.scaler_skipped() if final else 0,
        jpeg_decoded_pixels=float(statistics.median(observed.jpeg_decoded_pixels))
        if observed.jpeg_decoded_pixels else None,
        trials=observed.trials, flops_per_step=observed.flops_per_step, flops_reason=observed.flops_reason,
        peak=peak, peak_error=peak_error,
        collectives=collectives_json(observed.comm_at_warmup, observed.comm_at_end, collectives),
        worker_window=end.since(start) if start is not None and end is not None else None,
        device_step_s=tuple(timer.step_seconds()) if final and timer.pairs else None,
        gpu_memory_fraction=_gpu_memory_fraction(device, observed.device_index) if final else None)


def _peak(observed: Observations, kind: str) -> tuple[Peak | None, str | None]:
    """The peak MFU is measured against: that of the fastest path the run's precision takes at its thread count (a
    datasheet's dense figure for a known GPU, else measured: flops.py). Under autocast that is the faster of the
    autocast dtype's peak and float32's: autocast runs part of the step in float32, and where the device emulates
    the low precision (bf16 on a CPU without AVX512-BF16 or AMX: 1.35 GFLOP/s against several times that in fp32) its
    own peak is below what a healthy run achieves."""
    device = torch.device(kind) if observed.device_index is None else torch.device(kind, observed.device_index)
    autocast = [dtype for where, dtype in sorted(observed.autocast) if where == kind]
    dtype_name = autocast[0] if autocast else next(iter(sorted(observed.parameter_dtypes)), "float32")
    dtype = getattr(torch, dtype_name, torch.float32)
    try:
        peak = peak_flops(device, dtype, threads=observed.threads or None)
        if autocast and dtype != torch.float32:
            peak = max(peak, peak_flops(device, torch.float32, threads=observed.threads or None),
                       key=lambda p: p.flops_per_s)
    except (RuntimeError, ValueError) as e:  # a dtype without matmuls on this device
        return None, f"no peak for {dtype_name} on {device}: {e}"
    return peak, None


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
