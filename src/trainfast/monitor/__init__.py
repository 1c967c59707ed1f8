"""System monitor: a background thread sampling CPU, RAM, loader workers and GPUs (NVML, no nvidia-smi)."""

from trainfast.monitor.analysis import (
    Stats,
    detect_sawtooth,
    growth_per_minute,
    percentile,
    stats,
    sustained_growth_per_minute,
)
from trainfast.monitor.sampler import Monitor
from trainfast.monitor.sources import FakeSource, NvmlSource, PsutilSource, Source, TorchCudaSource

__all__ = ["FakeSource", "Monitor", "NvmlSource", "PsutilSource", "Source", "Stats", "TorchCudaSource",
           "detect_sawtooth", "growth_per_minute", "percentile", "stats", "sustained_growth_per_minute"]
