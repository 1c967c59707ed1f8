"""The host this process runs on: how many CPUs it may really use, its memory, and how long a thread waited for a
CPU (`queued_s`).

`os.cpu_count()` reports the host's cores; in a container limited to 2 CPUs on a 64-core host it
says 64, and 64 loader workers then thrash. The affinity mask and the cgroup quota are what the
scheduler enforces.
"""

from __future__ import annotations

import math
import os
import platform
import threading
from pathlib import Path
from typing import NamedTuple

import psutil


class Memory(NamedTuple):
    """RAM in bytes; None where psutil cannot tell."""

    total: int | None
    available: int | None


def memory() -> Memory:
    try:
        vm = psutil.virtual_memory()
    except Exception:  # a restricted container or an unsupported platform: say "unknown", do not fail
        return Memory(None, None)
    return Memory(int(vm.total), int(vm.available))


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (falls back to `os.cpu_count()` where unsupported)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def cgroup_cpu_limit(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The cgroup CPU quota in CPUs (e.g. 1.5), or None when there is none.

    cgroup v2 keeps `max` as "<quota> <period>" ("max <period>" means unlimited); v1 keeps
    `cpu.cfs_quota_us` (-1 unlimited) and `cpu.cfs_period_us`.
    """
    root = Path(root)
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cpus(affinity: int, cgroup_limit: float | None) -> int:
    """CPUs a workload can keep busy: the affinity count, capped by the quota rounded up, at least 1."""
    cpus = affinity if cgroup_limit is None else min(affinity, math.ceil(cgroup_limit))
    return max(1, cpus)


def available_cpus() -> int:
    """`usable_cpus` for this process, read from the system."""
    return usable_cpus(affinity_cpus(), cgroup_cpu_limit())


# Linux keeps each thread's run delay (the time it was ready to run but waited for a CPU) in /proc schedstat
QUEUE_KNOWN = os.path.exists(f"/proc/{os.getpid()}/schedstat")
_schedstat = threading.local()


class _Schedstat:
    """One thread's schedstat file, kept open (a read through it costs ~1.5 us, an open/read/close ~10 us) and
    closed when the thread ends and its locals go."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self.fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        os.close(self.fd)


def queued_s() -> float:
    """Seconds the calling thread has been ready to run but waiting for a CPU, since it started (take differences);
    0.0 where the kernel does not tell (`QUEUE_KNOWN`)."""
    if not QUEUE_KNOWN:
        return 0.0
    tid = threading.get_native_id()
    try:
        stat = getattr(_schedstat, "stat", None)
        if stat is None or stat.tid != tid:  # a new thread, or this one in a forked child: its own file
            stat = _schedstat.stat = _Schedstat(tid)
        return int(os.pread(stat.fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14 96-Core Processor"), or the platform's processor or architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
