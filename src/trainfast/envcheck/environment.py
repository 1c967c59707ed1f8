"""This machine as training sees it (`environment`), the loader checks to run before the first batch
(`preflight`), room for the checkpoints (`checkpoint_preflight`), and the block users paste into bug reports
(`bug_report_block`)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from trainfast.atomic import free_bytes
from trainfast.envcheck import checks
from trainfast.host import affinity_cpus, cgroup_cpu_limit, cpu_model, memory, usable_cpus
from trainfast.units import format_bytes
from trainfast.version import __version__

# The JSON fields `environment()` always has (a contract for tools that read `trainfast env --json`).
CONTRACT_FIELDS = ("python", "torch", "cuda_available", "cpu_count", "cpu_affinity", "cgroup_cpu_limit",
                   "memory_bytes", "shm_bytes", "gpus", "checks")


def gpus() -> list[dict[str, Any]]:
    """One {index, name, capability: [major, minor], memory_bytes} per visible CUDA device ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        try:
            props = torch.cuda.get_device_properties(index)
        except (RuntimeError, AssertionError):
            continue
        found.append({"index": index, "name": props.name, "capability": [props.major, props.minor],
                      "memory_bytes": int(props.total_memory)})
    return found


def environment() -> dict[str, Any]:
    """Versions, CPUs, memory, shared memory, GPUs and the machine-wide checks, as JSON-ready values.

    The fields in `CONTRACT_FIELDS` are always present; the others (`trainfast`, `platform`, `torch_cuda`,
    `cudnn`, `driver`, `usable_cpus`, `memory_available_bytes`, `open_files_limit`) may grow.
    """
    cuda = torch.cuda.is_available()
    affinity, limit = affinity_cpus(), cgroup_cpu_limit()
    total, available = memory()
    shm = checks.read_shm_bytes()
    nofile = checks.read_open_files_limit()
    devices = gpus()
    capability = (int(devices[0]["capability"][0]), int(devices[0]["capability"][1])) if devices else None
    precision, cudnn_tf32 = checks.read_tf32_settings()
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        cudnn = None
    found: list[checks.Check] = [
        checks.cpu_check(None, affinity, limit),
        checks.shm_check(shm, None, None, None),
        checks.open_files_check(nofile, None),
        checks.cuda_versions_check(),
        checks.nvml_check(),
        checks.tf32_check(cuda, capability, precision, cudnn_tf32),
        checks.cuda_alloc_conf_check(checks.read_cuda_alloc_conf(), cuda),
    ]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cgroup_cpu_limit": limit,
        "memory_bytes": total,
        "shm_bytes": shm,
        "gpus": devices,
        "checks": [c.to_json() for c in found],
        "trainfast": __version__,
        "platform": platform.platform(),
        "torch_cuda": torch.version.cuda,
        "cudnn": cudnn,
        "driver": checks.read_driver_version(),
        "usable_cpus": usable_cpus(affinity, limit),
        "cpu": cpu_model(),
        "memory_available_bytes": available,
        "open_files_limit": None if nofile is None or nofile >= checks.UNLIMITED else nofile,
    }


# --- preflight ---------------------------------------------------------------------------------------------


def _attr(obj: object, name: str) -> Any:
    """getattr that never raises (a property or `__getattr__` of an unknown loader may)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def loader_settings(loader: object) -> tuple[int | None, int | None]:
    """(num_workers, prefetch_factor) of a trainfast Loader / TensorLoader (from `.plan`), a torch DataLoader
    or anything wrapping one as `.dataloader`; None for what cannot be read."""
    plan = _attr(loader, "plan")
    if plan is not None and _count(_attr(plan, "num_workers")) is not None:
        return _count(_attr(plan, "num_workers")), _count(_attr(plan, "prefetch_factor"))
    for source in (loader, _attr(loader, "dataloader")):
        workers = _count(_attr(source, "num_workers")) if source is not None else None
        if workers is not None:
            return workers, _count(_attr(source, "prefetch_factor"))
    if _attr(loader, "tensors") is not None and _attr(loader, "batches") is not None:
        return 0, None  # a TensorLoader built without a plan: batched by indexing, in this process
    return None, None


def estimate_batch_bytes(loader: object) -> int | None:
    """Bytes per batch from shapes and declarations alone: tensors already in memory (a TensorLoader or a loader
    over a TensorDataset), or a dataset that declares its `sample_bytes` (as trainfast's `ImageFolder`); None for
    anything else (finding out would mean loading a batch)."""
    batch_size = _count(_attr(loader, "batch_size"))
    if not batch_size:
        return None
    tensors = _attr(loader, "tensors")
    dataset = _attr(loader, "dataset")
    if tensors is None:
        tensors = _attr(dataset, "tensors")
    if isinstance(tensors, (tuple, list)):
        return tensors_batch_bytes(tensors, batch_size)
    per_sample = _count(_attr(dataset, "sample_bytes"))
    return batch_size * per_sample if per_sample else None


def tensors_batch_bytes(tensors: tuple[Any, ...] | list[Any], batch_size: int) -> int | None:
    """Bytes in `batch_size` rows of `tensors` (all indexed along their first dimension), None if any is not
    a non-empty tensor."""
    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] > 0 for t in tensors):
        return None
    return batch_size * sum(int(t.element_size()) * (int(t.numel()) // int(t.shape[0])) for t in tensors)


def preflight(loader: object, *, batch_bytes: int | None = None) -> list[checks.Check]:
    """The checks to run on `loader` before its first batch: CPUs vs workers, /dev/shm room for the workers'
    batches, the open-files limit and open database handles on the dataset.

    Reads only settings and instance attributes: it never iterates the loader or indexes the dataset (that
    would open the very handles it warns about), and never raises on a loader type it does not know.
    `batch_bytes` (bytes per batch) sharpens the shared-memory check; for in-memory tensors it is estimated.
    """
    workers, prefetch = loader_settings(loader)
    busy = workers
    plan = _attr(loader, "plan")
    if _attr(plan, "backend") == "threads":
        # Loader threads fork nothing and pass nothing through /dev/shm; threads that mostly wait on reads keep only
        # the plan's loader_cores busy (64 threads on 2 CPUs are not 64 workers competing for them).
        busy = _count(_attr(plan, "loader_cores")) or workers
        workers = 0
    if batch_bytes is None:
        batch_bytes = estimate_batch_bytes(loader)
    found = [
        checks.cpu_check(busy, affinity_cpus(), cgroup_cpu_limit()),
        checks.shm_check(checks.read_shm_bytes(), workers, prefetch, batch_bytes),
        checks.open_files_check(checks.read_open_files_limit(), workers),
    ]
    dataset = _attr(loader, "dataset")
    if dataset is not None:
        found.append(checks.db_handles_check(dataset, num_workers=workers))
    return found


def checkpoint_preflight(folder: str | Path, checkpoint_bytes: int, keep: int, held_bytes: int = 0) -> checks.Check:
    """Room on the volume of `folder` for `keep` rotated checkpoints and best.pt of about `checkpoint_bytes`
    each, checked before training, not found out as a full disk at the end of an epoch. `held_bytes`: the
    checkpoints already in `folder` (a resumed run), which the new ones replace."""
    return checks.checkpoint_space_check(str(folder), free_bytes(folder), checkpoint_bytes, keep,
                                         held_bytes)


# --- the bug-report block ----------------------------------------------------------------------------------


def _bytes(n: Any) -> str:
    return format_bytes(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else "unknown"


def bug_report_block(env: dict[str, Any]) -> str:
    """A fenced text block with versions, CPUs, memory, shared memory, GPUs and the checks that are not ok,
    for pasting into a bug report. Accepts `environment()`'s dict (missing fields read "unknown")."""
    def get(key: str) -> Any:
        value = env.get(key)
        return "unknown" if value is None else value

    build = f"CUDA {env['torch_cuda']}" if env.get("torch_cuda") else "CPU-only build"
    extras = [f"cuDNN {env['cudnn']}"] if env.get("cudnn") else []
    if env.get("driver"):
        extras.append(f"driver {env['driver']}")
    quota = env.get("cgroup_cpu_limit")
    lines = [
        f"trainfast {get('trainfast')} | Python {get('python')} | torch {get('torch')} ({build})"
        + "".join(f" | {e}" for e in extras),
        f"platform: {get('platform')}",
        f"CPUs: {get('usable_cpus')} usable (os.cpu_count {get('cpu_count')}, affinity {get('cpu_affinity')}, "
        f"cgroup quota {'none' if quota is None else f'{quota:g}'})",
        f"memory: {_bytes(env.get('memory_bytes'))} | /dev/shm free: {_bytes(env.get('shm_bytes'))}",
    ]
    devices = env.get("gpus") or []
    if not devices:
        lines.append(f"GPUs: none (cuda_available={get('cuda_available')})")
    for gpu in devices:
        cap = gpu.get("capability") or ["?", "?"]
        lines.append(f"GPU {gpu.get('index')}: {gpu.get('name')} (sm_{cap[0]}{cap[1]}, "
                     f"{_bytes(gpu.get('memory_bytes'))})")
    order = {"fail": 0, "warn": 1, "info": 2}
    flagged = sorted((c for c in env.get("checks") or [] if c.get("status") != "ok"),
                     key=lambda c: order.get(c.get("status"), 3))
    lines.append("checks: all ok" if not flagged else "checks that are not ok:")
    for check in flagged:
        lines.append(f"  [{check.get('status')}] {check.get('name')}: {check.get('detail')}")
    return "```text\n" + "\n".join(lines) + "\n```"
