"""A short description of the machine a measurement ran on (provenance for every figure)."""

from __future__ import annotations

import platform
from typing import Any

import psutil
import torch

from trainfast.host import affinity_cpus, cgroup_cpu_limit, cpu_model
from trainfast.units import format_bytes


def hardware() -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    return {"cpu": cpu_model(), "cpus": affinity_cpus(), "cgroup_cpu_limit": cgroup_cpu_limit(),
            "memory_bytes": psutil.virtual_memory().total, "gpus": gpus, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def describe(hw: dict[str, Any]) -> str:
    gpus = ", ".join(hw["gpus"]) or "no GPU"
    return f"{hw['cpu']}, {hw['cpus']} CPUs, {format_bytes(hw['memory_bytes'])}, {gpus}, torch {hw['torch']}"
