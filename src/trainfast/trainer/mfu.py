"""The Trainer's model FLOP utilisation: one batch's FLOPs, counted once per Trainer on a warm-up step, over the
device's peak at the settled precision, taken once per fit."""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from trainfast.flops import FlopCounter, Peak, Utilisation, measured_peak, peak_flops, precision_of, utilisation

log = logging.getLogger("trainfast")
# The time fit gives a measured peak (a CPU, MPS), against `measured_peak`'s default 1 s: the best of 15-35 matmuls came
# within 1 % of the best of 50 (AMD EPYC, 1024x1024: bf16 at 1 thread 0.210-0.213 against 0.209-0.213 TFLOP/s over 4
# tries each; bf16 and fp32 at 2 threads alike), and the rest of that second was 5-7 % of a 3-epoch run of the quick
# demo (`other` in fit's whole-run report).
PEAK_BUDGET_S = 0.2


class MfuMeter:
    def __init__(self) -> None:
        self.flops: int | None = None  # one batch's, forward and backward
        self.samples = 0  # in that batch
        self.peak: Peak | None = None
        self.reason: str | None = None  # why no FLOPs are counted

    def check(self, model: nn.Module) -> None:
        """Before a fit's first step: can this model's FLOPs be counted (see `_uncountable`)?"""
        if self.flops is None:
            self.reason = _uncountable(model)

    @property
    def wants_count(self) -> bool:
        return self.flops is None and self.reason is None

    @contextmanager
    def counting(self, samples: int) -> Iterator[None]:
        """Count the FLOPs of the block (a forward and backward of a batch of `samples`; the optimizer's FLOPs are
        elementwise and would count 0 anyway)."""
        with FlopCounter() as counter:
            yield
        self.flops, self.samples = counter.total, samples

    def take_peak(self, device: torch.device, dtype: torch.dtype, say: bool) -> float:
        """The device's peak FLOP/s at the run's matmul precision and thread count, when FLOPs are counted; the
        seconds it took. A measured peak costs ~0.2 s on a CPU (~1 s on an unlisted GPU), once per process for each
        setting."""
        started = time.perf_counter()
        if self.reason is None:
            self.peak = device_peak(device, dtype, threads=torch.get_num_threads())
            if say:
                log.info("peak %.3g TFLOP/s for MFU (%s)", self.peak.flops_per_s / 1e12, self.peak.source)
        return time.perf_counter() - started

    def at(self, samples_per_s: float) -> Utilisation | None:
        """MFU at this device's rate of `samples_per_s`: the counted batch's FLOPs over its time at that rate."""
        if self.flops is None or self.peak is None or not samples_per_s > 0:
            return None
        return utilisation(self.flops, self.samples / samples_per_s, self.peak)

    def why_none(self, use: Utilisation | None) -> str | None:
        """The reason a fit's result has no MFU (None when it has one)."""
        if use is not None:
            return use.error
        return self.reason or ("no training step was counted" if self.flops is None
                               else "the run ended before its A/Bs settled the precision" if self.peak is None
                               else "no training step was timed")


def device_peak(device: torch.device, dtype: torch.dtype, *, threads: int) -> Peak:
    """`peak_flops` on CUDA (a known GPU's datasheet figure, else measured); elsewhere measured within
    `PEAK_BUDGET_S`, once per process for each device, dtype, thread count and precision."""
    if device.type == "cuda":
        return peak_flops(device, dtype, threads=threads)
    return _measured_briefly(device, dtype, threads, precision_of(device, dtype))


@functools.lru_cache(maxsize=16)
def _measured_briefly(device: torch.device, dtype: torch.dtype, threads: int, precision: str) -> Peak:
    return measured_peak(device, dtype, threads=threads, budget_s=PEAK_BUDGET_S)


def weight_dtype(model: nn.Module) -> torch.dtype:
    """The dtype an un-autocast model's matmuls run in: its first floating parameter's (float32 if unusual)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32


def _uncountable(model: nn.Module) -> str | None:
    """Why this model's FLOPs can't be counted: a compiled module would recompile under the counter's dispatch mode
    (and its graph holds no aten calls to count). None when they can."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing was compiled
    if eval_frame is not None and any(isinstance(m, eval_frame.OptimizedModule) for m in model.modules()):
        reason = ("FLOPs not counted: the model is compiled, and counting them (a dispatch mode) would make "
                  "torch.compile recompile")
        log.info("MFU: %s", reason)
        return reason
    return None
