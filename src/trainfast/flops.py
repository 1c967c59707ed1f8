"""Model FLOPs utilisation (MFU): the FLOPs a step does over the time it takes, as a fraction of the device's peak.

FLOPs are counted by torch's FlopCounterMode: matmuls, convolutions and attention at their textbook cost (2 per
multiply-add), whatever the kernels did; elementwise ops and the optimizer count 0, a recomputed (checkpointed)
forward counts again. The peak is a datasheet's *dense* figure for a known NVIDIA GPU at the precision the
matmuls run in, else the best rate of square matmuls measured here (CPU, MPS, an unlisted or MIG-sliced GPU).
The first count in a process imports torch._dynamo (~1 s on a 2-core CPU): the dispatch mode goes through it.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

PRECISIONS = ("bf16", "fp16", "tf32", "fp32", "fp64")
TARGET_S = 0.005  # one timed matmul at least this long: timer and launch noise (~10 us) stay under 1 %
MAX_N = 16384  # 3 such bf16 matrices take 1.6 GB; an H200 runs one bf16 matmul of this size in ~9 ms
MAX_RUNS = 50

_T = 1e12
# Dense peaks in FLOP/s per GPU model: the datasheet's "with sparsity" figures halved; fp64 is the FP64 Tensor
# Core figure where there is one (cuBLAS DGEMM runs on it); a precision a datasheet does not list is absent.
_TABLE: dict[str, dict[str, float]] = {
    # H100 datasheet, Hopper whitepaper: SXM5 bf16/fp16 1,979* (989.4 dense), tf32 989* (494.7), fp32, fp64 TC 67 (66.9)
    "H100 SXM": {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "tf32": 494.7 * _T, "fp32": 66.9 * _T, "fp64": 66.9 * _T},
    # H100 datasheet: PCIe bf16/fp16 1,513*, tf32 756*, fp32 and fp64 TC 51
    "H100 PCIe": {"bf16": 756.5 * _T, "fp16": 756.5 * _T, "tf32": 378 * _T, "fp32": 51 * _T, "fp64": 51 * _T},
    # H100 datasheet: NVL (per GPU) bf16/fp16 1,671*, tf32 835*, fp32 and fp64 TC 60
    "H100 NVL": {"bf16": 835.5 * _T, "fp16": 835.5 * _T, "tf32": 417.5 * _T, "fp32": 60 * _T, "fp64": 60 * _T},
    # A100 datasheet (SXM4 and PCIe, 40 and 80 GB alike): bf16/fp16 312 | 624*, tf32 156 | 312*, fp32 19.5, fp64 TC 19.5
    "A100": {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T, "fp64": 19.5 * _T},
    # A10 datasheet: bf16/fp16 125 | 250*, tf32 62.5 | 125*, fp32 31.2
    "A10": {"bf16": 125 * _T, "fp16": 125 * _T, "tf32": 62.5 * _T, "fp32": 31.2 * _T},
    # A10G (AWS EC2 G5; NVIDIA publishes no datasheet): bf16/fp16 70, tf32 35, fp32 35, dense
    "A10G": {"bf16": 70 * _T, "fp16": 70 * _T, "tf32": 35 * _T, "fp32": 35 * _T},
    # L4 datasheet: bf16/fp16 242*, tf32 120*, fp32 30.3
    "L4": {"bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T, "fp32": 30.3 * _T},
    # L40 datasheet: bf16/fp16 181.05 | 362.1*, tf32 90.5 | 181*, fp32 90.5
    "L40": {"bf16": 181.05 * _T, "fp16": 181.05 * _T, "tf32": 90.5 * _T, "fp32": 90.5 * _T},
    # L40S datasheet: bf16/fp16 362.05 | 733*, tf32 183 | 366*, fp32 91.6
    "L40S": {"bf16": 362.05 * _T, "fp16": 362.05 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T},
    # V100 datasheet (Volta: no bf16, no tf32, no sparsity): SXM2 tensor fp16 125, fp32 15.7, fp64 7.8
    "V100 SXM2": {"fp16": 125 * _T, "fp32": 15.7 * _T, "fp64": 7.8 * _T},
    "V100 PCIe": {"fp16": 112 * _T, "fp32": 14 * _T, "fp64": 7 * _T},  # V100 datasheet: PCIe 112, 14, 7
    "V100S PCIe": {"fp16": 130 * _T, "fp32": 16.4 * _T, "fp64": 8.2 * _T},  # V100S datasheet: 130, 16.4, 8.2
    "T4": {"fp16": 65 * _T, "fp32": 8.1 * _T},  # T4 datasheet: mixed fp16/fp32 65, fp32 8.1 (Turing: no bf16)
    # Ada whitepaper: RTX 4090 bf16/fp16 tensor with fp32 accumulate (torch's) 165.2 | 330.4*, tf32 82.6, fp32 82.6
    "RTX 4090": {"bf16": 165.2 * _T, "fp16": 165.2 * _T, "tf32": 82.6 * _T, "fp32": 82.6 * _T},
    # GA102 whitepaper: RTX 3090 bf16/fp16 with fp32 accumulate 71 | 142*, tf32 35.6 | 71*, fp32 35.6
    "RTX 3090": {"bf16": 71 * _T, "fp16": 71 * _T, "tf32": 35.6 * _T, "fp32": 35.6 * _T},
    # GA102 whitepaper and RTX A6000 datasheet: bf16/fp16 154.8 | 309.7*, tf32 77.4 | 154.8*, fp32 38.7
    "RTX A6000": {"bf16": 154.8 * _T, "fp16": 154.8 * _T, "tf32": 77.4 * _T, "fp32": 38.7 * _T},
}
_TABLE["H200 SXM"] = _TABLE["GH200"] = _TABLE["H100 SXM"]  # H200 and GH200 datasheets: the H100 SXM's figures
_TABLE["H200 NVL"] = _TABLE["H100 NVL"]  # H200 NVL datasheet: 1,671*, 835*, 60
# torch.cuda.get_device_name() as normalised by _key -> table row. Matched whole, so a MIG slice ("... MIG 1g.10gb",
# a fraction of the SMs), an RTX 4090 D (fewer SMs) or a V100 SXM3 gets no row and is measured instead. A bare
# "H100" gets none either: PCIe (756.5 bf16) and SXM (989.4) differ by 1.3x, so it is measured too.
_NAMES = {"H100 HBM3": "H100 SXM", "H100 SXM5": "H100 SXM", "H100 SXM5 HBM3": "H100 SXM", "H100 SXM": "H100 SXM",
          "H100 PCIE": "H100 PCIe", "H100 HBM2E": "H100 PCIe", "H100 NVL": "H100 NVL", "H200": "H200 SXM",
          "H200 HBM3E": "H200 SXM", "H200 NVL": "H200 NVL", "GH200": "GH200", "A100": "A100", "A100 SXM4": "A100",
          "A100 SXM": "A100", "A100 PCIE": "A100", "A10": "A10", "A10G": "A10G", "L4": "L4", "L40": "L40",
          "L40S": "L40S", "V100 SXM2": "V100 SXM2", "V100 PCIE": "V100 PCIe", "V100S PCIE": "V100S PCIe",
          "T4": "T4", "RTX 4090": "RTX 4090", "RTX 3090": "RTX 3090", "RTX A6000": "RTX A6000"}


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    precision: str  # "bf16", "fp16", "tf32", "fp32" or "fp64"
    source: str  # "table: NVIDIA H100 SXM, dense bf16 (datasheet)" or "measured: 1024x1024 float32 matmul, ..."


def precision_of(device: torch.device, dtype: torch.dtype) -> str:
    """The precision the run's matmuls use: float32 on CUDA is TF32 where torch allows it for matmuls."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    if dtype in names:
        return names[dtype]
    if dtype != torch.float32:
        raise ValueError(f"dtype={dtype} has no matmul peak here; use one of bfloat16, float16, float32, float64")
    return "tf32" if device.type == "cuda" and _tf32_matmul() else "fp32"


def _tf32_matmul() -> bool:
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9; the legacy getter raises once the two APIs disagree
        return str(matmul.fp32_precision) == "tf32"
    return bool(matmul.allow_tf32)


def _key(device_name: str) -> str:
    words = re.split(r"[\s_-]+", device_name.upper())
    return " ".join(w for w in words if w and w not in ("NVIDIA", "TESLA", "GEFORCE") and not re.fullmatch(r"\d+GB", w))


def table_peak(device_name: str, precision: str) -> Peak | None:
    """The datasheet's dense peak of this GPU at `precision`; None for a GPU or precision the table lacks."""
    row = _NAMES.get(_key(device_name))
    flops = _TABLE[row].get(precision) if row else None
    return None if flops is None else Peak(flops, precision, f"table: NVIDIA {row}, dense {precision} (datasheet)")


def measured_peak(device: torch.device, dtype: torch.dtype, *, threads: int | None = None,
                  budget_s: float = 1.0) -> Peak:
    """The best FLOP/s of square `dtype` matmuls on `device` (with `threads` intra-op threads, put back after).

    n doubles from 256 until one matmul takes TARGET_S (each size's first run a warm-up), then it repeats until
    `budget_s` is spent. Inputs come from a private generator: the caller's random streams are left alone."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        deadline, n = time.perf_counter() + budget_s, 256
        while True:
            g = torch.Generator(device).manual_seed(0)
            a, b = (torch.rand(n, n, generator=g, device=device).to(dtype) for _ in range(2))
            out = torch.empty_like(a)
            _timed_mm(a, b, out)  # warm-up: allocation, kernel or primitive selection
            took = _timed_mm(a, b, out)
            # the next size costs ~16x this (8x the work, warm-up and timed run): only if the budget allows
            if took >= TARGET_S or 2 * n > MAX_N or time.perf_counter() + 16 * took > deadline:
                break
            n *= 2
        best, runs = took, 1
        while runs < MAX_RUNS and time.perf_counter() + took < deadline:
            best, runs = min(best, _timed_mm(a, b, out)), runs + 1
        used = torch.get_num_threads()
    finally:
        if threads is not None:
            torch.set_num_threads(before)
    where = f"{used} thread{'s' * (used != 1)}" if device.type == "cpu" else f"on {_device_name(device)}"
    precision = precision_of(device, dtype)
    kind = str(dtype).removeprefix("torch.") + (" (tf32)" if precision == "tf32" else "")
    return Peak(2 * n**3 / best, precision, f"measured: {n}x{n} {kind} matmul, {where}, best of {runs}")


def _timed_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    _synchronize(a.device)  # the clock starts and stops with nothing else queued on the device
    started = time.perf_counter()
    torch.mm(a, b, out=out)
    _synchronize(a.device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_flops(device: torch.device, dtype: torch.dtype, *, threads: int | None = None) -> Peak:
    """The table's figure for a known CUDA GPU at the run's matmul precision, else a peak measured once per process
    for each device, dtype, thread count and precision: ~1 s, which a process that trains or diagnoses many times (a
    sweep, a notebook, the tests: 29 doctor runs paid 19 s) would pay at each."""
    precision, name = precision_of(device, dtype), _device_name(device)
    if device.type == "cuda":
        known = table_peak(name, precision)
        if known is not None:
            return known
    return _measured_once(device, name, dtype, torch.get_num_threads() if threads is None else threads, precision)


@functools.lru_cache(maxsize=16)
def _measured_once(device: torch.device, name: str, dtype: torch.dtype, threads: int, precision: str) -> Peak:
    """Keyed by all that changes the figure: the device, dtype and threads, and the precision (TF32 on or off changes
    a float32 peak on CUDA)."""
    return measured_peak(device, dtype, threads=threads)


class FlopCounter:
    """FLOPs counted between `start()` and `stop()` (or in a `with` block), summed over every such span.

    A TorchDispatchMode underneath: spans must nest properly with other modes, and a model compiled with
    torch.compile recompiles under it (don't count those)."""

    def __init__(self) -> None:
        self.total = 0
        self._mode: FlopCounterMode | None = None

    def start(self) -> FlopCounter:
        if self._mode is None:
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()
        return self

    def stop(self) -> int:
        """The FLOPs counted so far; stopping a stopped counter changes nothing."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            self.total += mode.get_total_flops()
        return self.total

    def __enter__(self) -> FlopCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def count_flops(fn: Callable[[], object]) -> int:
    """The FLOPs of one call of `fn` (a forward, or a forward and its backward)."""
    with FlopCounter() as counter:
        fn()
    return counter.total


@dataclass(frozen=True)
class Utilisation:
    flops_per_step: int
    achieved_flops_per_s: float
    peak: Peak
    mfu: float | None  # None when it would be over 1 or nothing was counted: see `error`
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"flops_per_step": self.flops_per_step, "achieved_flops_per_s": self.achieved_flops_per_s,
                "peak_flops_per_s": self.peak.flops_per_s, "peak_source": self.peak.source,
                "peak_precision": self.peak.precision, "mfu": self.mfu, "mfu_error": self.error}


def utilisation(flops_per_step: int, step_s: float, peak: Peak) -> Utilisation:
    """MFU of steps of `flops_per_step` FLOPs taking `step_s` each. Over 1 means the peak is wrong for this device
    (or the count is), so it is reported as an error, never as a utilisation."""
    if not step_s > 0 or not peak.flops_per_s > 0:
        raise ValueError(f"step_s={step_s!r} and peak.flops_per_s={peak.flops_per_s!r} must both be > 0")
    achieved = flops_per_step / step_s
    ratio = achieved / peak.flops_per_s
    if flops_per_step <= 0:
        error = ("no FLOPs counted: FlopCounterMode counts matmuls, convolutions and attention, and this step ran "
                 "none of them")
        return Utilisation(flops_per_step, achieved, peak, None, error)
    if ratio > 1:
        why = ("the table is wrong for this device" if peak.source.startswith("table")
               else "the measurement undershot (a busy machine), or kernels do fewer FLOPs than counted (Winograd)")
        return Utilisation(flops_per_step, achieved, peak, None, f"achieved {ratio:.1f}x the peak: {why} "
                                                                 f"({peak.source})")
    return Utilisation(flops_per_step, achieved, peak, ratio, None)
