"""Peak memory of a block of work, for `trainfast bench`'s precision rows: `with PeakMemory(device) as peak: ...`.

On CUDA it is the caching allocator's peak (`torch.cuda.max_memory_allocated`, reset on entry). On the CPU it is
how far this process's resident memory rose above its RSS on entry, read one of two ways (`method`):

- "vmhwm": the kernel's peak-RSS counter (VmHWM in /proc/self/status), reset on entry through
  /proc/self/clear_refs (Linux >= 4.0): exact, and free.
- "sampled": where that counter cannot be reset, a `Monitor` sampling the process's RSS every `RSS_INTERVAL_S`,
  fast enough to catch most of a training step's activations (a shorter peak may be missed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import psutil
import torch

from trainfast.device import synchronize
from trainfast.monitor import Monitor, PsutilSource

RSS_INTERVAL_S = 0.02  # fallback RSS sampling when the kernel's peak-RSS counter cannot be reset


def current_rss() -> int:
    """This process's resident memory now, in bytes."""
    return int(psutil.Process().memory_info().rss)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS: Linux >= 4.0, `echo 5 > clear_refs`."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _peak_rss() is not None


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


@dataclass
class PeakMemory:
    """Peak memory of the block it wraps: "cuda" (allocator peak) or "rss" (growth of this process's peak RSS)."""

    device: torch.device
    source: str = ""
    method: str = ""
    baseline: int = 0
    peak_bytes: int | None = None
    _monitor: Monitor | None = field(default=None, repr=False)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            self.source = self.method = "cuda"
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.source = "rss"
        self.baseline = current_rss()
        if _reset_peak_rss():
            self.method = "vmhwm"
        else:  # sample proc.rss_bytes fast enough to catch most of a step's activations
            self.method = "sampled"
            self._monitor = Monitor(interval_s=RSS_INTERVAL_S, sources=[PsutilSource(per_core=False)]).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)  # the row's last kernels may still allocate
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        peak = current_rss()
        if self._monitor is not None:
            self._monitor.stop()
            rss = self._monitor.summary().get("proc.rss_bytes")
            if rss is not None:
                peak = max(peak, int(rss.maximum))
        else:
            peak = max(peak, _peak_rss() or 0)
        self.peak_bytes = max(0, peak - self.baseline)
