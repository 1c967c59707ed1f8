"""How far compute is from the hardware's peak: the report's `compute` entry, and what it adds to a compute-bound
verdict."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from trainfast.diagnose.classify import Verdict
from trainfast.diagnose.instrument import Instrumentation
from trainfast.diagnose.measured import device_of
from trainfast.diagnose.timeline import StepRecord
from trainfast.flops import peak_flops, utilisation

# MFU bands for a compute-bound verdict: near the peak only less work helps; far below it the step is made of
# small kernels, launch overhead or the wrong layout/precision, which compile, a larger batch or CUDA graphs fix.
NEAR_PEAK, FAR_BELOW_PEAK = 0.5, 0.2
COUNTED = ("one whole training step after the measured ones, as the script ran it (matmuls, convolutions and "
           "attention at 2 FLOPs per multiply-add; elementwise ops and the optimizer count 0)")


def compute_entry(instrumentation: Instrumentation, records: list[StepRecord]) -> dict[str, Any] | None:
    """The report's `compute` entry: the counted step's FLOPs over the mean measured step, against the peak of the
    fastest path the run's precision takes at its thread count (a datasheet's dense figure for a known GPU, else
    measured: flops.py). Under autocast that is the faster of the autocast dtype's peak and float32's: autocast
    runs part of the step in float32, and where the device emulates the low precision (bf16 on a CPU without
    AVX512-BF16 or AMX: 1.35 GFLOP/s against several times that in fp32) its own peak is below what a healthy
    run achieves."""
    if not records:
        return None
    flops = instrumentation.observed.flops_per_step
    if flops is None:
        return {"flops_per_step": None, "reason": instrumentation.observed.flops_reason or "no step was counted"}
    observed = instrumentation.observed
    kind = device_of(observed)
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
        return {"flops_per_step": flops, "reason": f"no peak for {dtype_name} on {device}: {e}"}
    step_s = statistics.fmean(r.total_s for r in records)
    return utilisation(flops, step_s, peak).to_json() | {"covers": COUNTED, "reason": None}


def with_peak(verdict: Verdict, compute: dict[str, Any] | None, device: str = "cuda",
              precision_hint: bool = True) -> Verdict:
    """A compute-bound verdict says how far from the peak the compute runs, which decides the fix. `precision_hint`
    False: the report measured another precision no faster (or the run's own slower), so none is suggested."""
    mfu = compute.get("mfu") if compute else None
    if verdict.name != "compute-bound" or mfu is None or compute is None:
        return verdict
    source = "a datasheet's" if str(compute["peak_source"]).startswith("table") else "a measured"
    where = f"model FLOPs utilisation {mfu:.0%} of {source} {compute['peak_precision']} peak"
    if mfu >= NEAR_PEAK:
        faster = " or a faster precision" if precision_hint else ""
        advice = ("near the hardware's limit at this precision: only less work (a smaller model, fewer FLOPs per "
                  f"sample){faster} helps")
    elif mfu < FAR_BELOW_PEAK:
        hints = ["torch.compile", "a larger batch"] + (["mixed precision"] if precision_hint else []) + \
            (["CUDA graphs"] if device == "cuda" else [])
        held = "layout or precision" if precision_hint else "layout"
        advice = (f"far below the peak: small kernels, launch overhead, {held} hold it back "
                  f"({', '.join(hints)})")
    else:
        advice = "between the two: both more efficient kernels and less work can help"
    return Verdict(verdict.name, f"{verdict.reason}; {where}: {advice}")
