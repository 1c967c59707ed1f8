"""The host this process runs on: how many CPUs it may really use, and its memory.

`os.cpu_count()` reports the host's cores; in a container limited to 2 CPUs on a 64-core host it
says 64, and 64 loader workers then thrash. The affinity mask and the cgroup quota are what the
scheduler enforces.
"""

from __future__ import annotations

import math
import os
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
