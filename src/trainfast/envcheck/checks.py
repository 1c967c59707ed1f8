"""Pre-flight checks: one small function per check, each returning a `Check` that says what it measured and the fix.

The checks are pure: what they judge (CPU counts, free shared memory, the open-files limit, room for checkpoints,
torch settings) is passed in, and the `read_*` functions next to them read it from this machine. That keeps every
verdict testable with made-up numbers, and lets `preflight` and `trainfast env` share them. The walk that finds
open handles on a dataset, for `db_handles_check`, is in handles.py.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Literal

import torch

from trainfast.envcheck.handles import find_handles
from trainfast.host import usable_cpus
from trainfast.units import MIB, format_bytes

Status = Literal["ok", "warn", "fail", "info"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "info")

# Below this, /dev/shm is too small for DataLoader workers (Docker gives containers 64 MiB by default).
TINY_SHM_BYTES = 256 * MIB
# With workers, each shared tensor costs a file descriptor under the default sharing strategy.
LOW_OPEN_FILES = 4096
# torch.utils.data.DataLoader's prefetch_factor when workers are used and none is given.
DEFAULT_PREFETCH_FACTOR = 2
# A soft limit at or above this is reported as "unlimited".
UNLIMITED = 2**62

SHM_FIX = ('give the container more shared memory (docker run --shm-size=8g, or --ipc=host; Kubernetes: an '
           'emptyDir with medium: Memory mounted at /dev/shm), use fewer workers or a lower prefetch_factor, '
           'or call torch.multiprocessing.set_sharing_strategy("file_system")')
DB_FIX = ("open the handle lazily on first use in __getitem__ (if self.db is None: self.db = connect(...)) "
          "or in worker_init_fn, so each worker opens its own; keep only the path on the dataset")


@dataclass(frozen=True)
class Check:
    """One verdict: `status` is "ok", "warn" (slower or fragile), "fail" (will break) or "info" (for the record)."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} is not valid; use one of {', '.join(STATUSES)}")

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


# --- CPUs -----------------------------------------------------------------------------------------------


def cpu_check(num_workers: int | None, affinity: int, cgroup_limit: float | None) -> Check:
    """Warn when loader workers outnumber the CPUs this process may use (affinity capped by the cgroup quota)."""
    usable = usable_cpus(affinity, cgroup_limit)
    quota = "no cgroup CPU quota" if cgroup_limit is None else f"cgroup quota {cgroup_limit:g} CPUs"
    source = f"affinity {affinity} CPUs, {quota}"
    if num_workers is None:
        return Check("cpu", "info", f"{usable} usable CPUs ({source})")
    if num_workers > usable:
        return Check("cpu", "warn",
                     f"num_workers={num_workers} exceeds the {usable} usable CPUs ({source}): the workers and the "
                     "training process take turns on the same cores, so every step gets slower",
                     f"use num_workers <= {max(0, usable - 1)} (usable CPUs - 1, one core for the training "
                     "process) or workers='auto' in trainfast.make_loader")
    return Check("cpu", "ok", f"num_workers={num_workers} within the {usable} usable CPUs ({source})")


# --- shared memory ---------------------------------------------------------------------------------------


def read_shm_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes in the shared-memory filesystem at `path`, or None where it cannot be read (macOS, Windows)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return int(st.f_bavail * st.f_frsize)


def shm_needed_bytes(num_workers: int, prefetch_factor: int | None, batch_bytes: int) -> int:
    """Shared memory the workers' batches may hold at once: workers x prefetch_factor batches, x 2 for the
    pinned copy / the next batch being written while the last one is still referenced."""
    prefetch = DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor
    return num_workers * prefetch * batch_bytes * 2


def shm_check(shm_bytes: int | None, num_workers: int | None, prefetch_factor: int | None,
              batch_bytes: int | None) -> Check:
    """DataLoader workers hand batches to the training process through /dev/shm: is there room for them?

    `num_workers=None` means not known yet (`trainfast env`): judged as if workers will be used.
    """
    if shm_bytes is None:
        return Check("shm", "info", "/dev/shm free space unknown (not readable on this system)")
    free = format_bytes(shm_bytes)
    if num_workers == 0:
        return Check("shm", "ok", f"/dev/shm {free} free; num_workers=0, so batches do not pass through it")
    prefetch = DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor
    who = "DataLoader workers" if num_workers is None else f"num_workers={num_workers}"
    if batch_bytes is not None and num_workers is not None:
        need = shm_needed_bytes(num_workers, prefetch, batch_bytes)
        sizing = (f"{num_workers} workers x prefetch_factor {prefetch} x {format_bytes(batch_bytes)} per batch "
                  f"x 2 = {format_bytes(need)}")
        if shm_bytes < need:
            return Check("shm", "fail",
                         f"/dev/shm has {free} free but {who} need about {sizing}: workers will die with "
                         "'bus error' / 'No space left on device'", SHM_FIX)
        if shm_bytes < 2 * need:
            return Check("shm", "warn", f"/dev/shm has {free} free, less than twice the {sizing}: "
                         "a larger batch or one more worker and they crash with 'bus error'", SHM_FIX)
    else:
        sizing = ""
    if shm_bytes < TINY_SHM_BYTES:
        return Check("shm", "warn",
                     f"/dev/shm has only {free} free (< {format_bytes(TINY_SHM_BYTES)}; Docker's default is 64 MiB): "
                     f"{who} pass every batch through it and crash with 'bus error' once it is full", SHM_FIX)
    needed = f"; need about {sizing}" if sizing else ""
    return Check("shm", "ok", f"/dev/shm has {free} free{needed}")


# --- open files --------------------------------------------------------------------------------------------


def read_open_files_limit() -> int | None:
    """The soft RLIMIT_NOFILE (`ulimit -n`); `UNLIMITED` when unlimited, None where unsupported (Windows)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    return UNLIMITED if soft == resource.RLIM_INFINITY or soft >= UNLIMITED else int(soft)


def open_files_check(soft_limit: int | None, num_workers: int | None) -> Check:
    """With workers, torch's default "file_descriptor" sharing strategy keeps a descriptor per shared tensor."""
    if soft_limit is None:
        return Check("open_files", "info", "open-files limit unknown (no RLIMIT_NOFILE on this system)")
    shown = "unlimited" if soft_limit >= UNLIMITED else str(soft_limit)
    if num_workers == 0:
        return Check("open_files", "ok", f"open-files soft limit {shown}; num_workers=0 shares no tensors")
    if soft_limit < LOW_OPEN_FILES:
        who = "DataLoader workers" if num_workers is None else f"num_workers={num_workers}"
        return Check("open_files", "warn",
                     f"open-files soft limit is {shown} (< {LOW_OPEN_FILES}): {who} share each tensor through a "
                     "file descriptor (the default 'file_descriptor' strategy) and can hit "
                     "'Too many open files' (EMFILE)",
                     'raise it before starting (ulimit -n 65536) or call '
                     'torch.multiprocessing.set_sharing_strategy("file_system")')
    return Check("open_files", "ok", f"open-files soft limit {shown} (>= {LOW_OPEN_FILES})")


# --- room for checkpoints ----------------------------------------------------------------------------------


def checkpoint_files_needed(keep: int) -> int:
    """Checkpoint files on disk at the worst moment: `keep` rotated last.pt files, best.pt, and the temporary
    copy that replaces best.pt (atomic writes hold the old file until the new one is complete)."""
    return keep + 2


def checkpoint_space_check(folder: str, free_bytes: int | None, checkpoint_bytes: int, keep: int,
                           held_bytes: int = 0) -> Check:
    """Is there room in `folder` for the checkpoints training keeps there, each about `checkpoint_bytes` (model
    and optimizer state)? `held_bytes`: checkpoints already there, which the new ones replace."""
    if free_bytes is None:
        return Check("checkpoint_space", "info", f"free space in {folder!r} unknown (not readable on this system)")
    files = checkpoint_files_needed(keep)
    need = files * checkpoint_bytes
    room = free_bytes + held_bytes
    held = f" (+ {format_bytes(held_bytes)} in the checkpoints already there, which get replaced)" if held_bytes else ""
    sizing = (f"each checkpoint takes about {format_bytes(checkpoint_bytes)} (model and optimizer state), and up to "
              f"{files} are on disk at once (keep_checkpoints={keep}, best.pt and the copy that replaces it): "
              f"{format_bytes(need)}")
    fix = (f"free space in {folder!r}, lower keep_checkpoints (now {keep}), or use another checkpoint_dir "
           "(--checkpoint-dir) on a volume with room")
    if room < checkpoint_bytes:
        return Check("checkpoint_space", "fail",
                     f"checkpoint folder {folder!r} has {format_bytes(free_bytes)} free{held}, not enough for one "
                     f"checkpoint: {sizing}. The first save will stop training", fix)
    if room < need:
        return Check("checkpoint_space", "warn",
                     f"checkpoint folder {folder!r} has {format_bytes(free_bytes)} free{held}, less than training "
                     f"needs: {sizing}. A save that finds the disk full stops training (or skips best.pt)", fix)
    return Check("checkpoint_space", "ok",
                 f"checkpoint folder {folder!r} has {format_bytes(free_bytes)} free{held}; {sizing}")


# --- CUDA settings -----------------------------------------------------------------------------------------


def read_cuda_alloc_conf() -> str | None:
    """The allocator settings from the environment (`PYTORCH_ALLOC_CONF`, or the older `PYTORCH_CUDA_ALLOC_CONF`)."""
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def _alloc_options(value: str) -> dict[str, str]:
    options = {}
    for item in value.split(","):
        key, _, val = item.partition(":")
        options[key.strip().lower()] = val.strip().lower()
    return options


def cuda_alloc_conf_check(value: str | None, cuda: bool) -> Check:
    """Suggest expandable segments on CUDA: they avoid fragmentation OOMs close to the memory limit."""
    shown = "unset" if not value else repr(value)
    if not cuda:
        return Check("cuda_alloc_conf", "info", f"PYTORCH_CUDA_ALLOC_CONF {shown}; not used without CUDA")
    if value and _alloc_options(value).get("expandable_segments") == "true":
        return Check("cuda_alloc_conf", "ok", f"PYTORCH_CUDA_ALLOC_CONF={value!r}: expandable segments on")
    return Check("cuda_alloc_conf", "info",
                 f"PYTORCH_CUDA_ALLOC_CONF {shown}: without expandable segments the caching allocator fragments "
                 "and can run out of memory near the limit with free memory left in unusable pieces",
                 "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before Python starts)")


def read_tf32_settings() -> tuple[str, bool]:
    """(float32 matmul precision as "highest" | "high" | "medium", cuDNN TF32 allowed), tolerant of torch's
    newer `fp32_precision` API (mixing it with the legacy one makes the legacy getter raise)."""
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:
        new = str(getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"))
        precision = "high" if new == "tf32" else "highest"
    try:
        cudnn_tf32 = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        conv = getattr(torch.backends.cudnn, "conv", None)
        cudnn_tf32 = str(getattr(conv, "fp32_precision", "tf32")) == "tf32"
    return precision, cudnn_tf32


def tf32_check(cuda: bool, capability: tuple[int, int] | None, matmul_precision: str, cudnn_tf32: bool) -> Check:
    """On Ampere and newer, fp32 matmuls at "highest" precision leave the TF32 tensor cores idle."""
    if not cuda or capability is None:
        return Check("tf32", "info", f"float32 matmul precision {matmul_precision!r}; TF32 needs a CUDA GPU")
    sm = f"sm_{capability[0]}{capability[1]}"
    if capability < (8, 0):
        return Check("tf32", "info", f"{sm} has no TF32 tensor cores (Ampere, sm_80, and newer do)")
    fixes = []
    problems = []
    if matmul_precision == "highest":
        problems.append(f"float32 matmul precision is 'highest' on {sm}: fp32 matmuls leave ~8x tensor-core "
                        "throughput unused")
        fixes.append('torch.set_float32_matmul_precision("high"), or precision="auto" in trainfast '
                     '(bf16 mixed precision on this GPU)')
    if not cudnn_tf32:
        problems.append("cuDNN TF32 is off (torch.backends.cudnn.allow_tf32=False): fp32 convolutions run slower")
        fixes.append("torch.backends.cudnn.allow_tf32 = True")
    if problems:
        return Check("tf32", "warn", "; ".join(problems), "; ".join(fixes))
    return Check("tf32", "ok", f"TF32 on for {sm} (matmul precision {matmul_precision!r}, cuDNN TF32 on)")


# --- versions and driver -----------------------------------------------------------------------------------


def read_driver_version() -> str | None:
    """The NVIDIA driver version through NVML, or None when there is no driver (never raises)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def versions_check(torch_version: str, torch_cuda: str | None, cudnn: int | None, driver: str | None,
                   cuda_available: bool) -> Check:
    """The pure half of `cuda_versions_check`: which torch build, which CUDA/cuDNN, which driver."""
    if torch_cuda is None:
        return Check("cuda_versions", "info", f"CPU-only torch build (torch {torch_version})"
                     + (f"; NVIDIA driver {driver} present" if driver else ""),
                     "install a CUDA build of torch to use the GPU (https://pytorch.org/get-started/locally/)"
                     if driver else "")
    detail = (f"torch {torch_version}, CUDA {torch_cuda}, cuDNN {cudnn if cudnn is not None else 'n/a'}, "
              f"driver {driver or 'n/a'}")
    if cuda_available:
        return Check("cuda_versions", "ok", detail)
    if driver is None:
        return Check("cuda_versions", "info", f"{detail}: no NVIDIA driver, so training runs on the CPU")
    return Check("cuda_versions", "warn", f"{detail}: a driver is present but CUDA is not available to torch",
                 f"check nvidia-smi and CUDA_VISIBLE_DEVICES; the driver must support CUDA {torch_cuda} "
                 "(upgrade the driver or install a torch build for an older CUDA)")


def cuda_versions_check() -> Check:
    """torch's CUDA and cuDNN versions and the driver's, read from this machine."""
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        cudnn = None
    return versions_check(torch.__version__, torch.version.cuda, cudnn, read_driver_version(),
                          torch.cuda.is_available())


def nvml_check() -> Check:
    """Is NVML (the driver's management library, used for GPU utilisation and memory) reachable? Never raises."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return Check("nvml", "info", "n/a (no NVIDIA driver)")
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        version = pynvml.nvmlSystemGetDriverVersion()
        driver = version.decode() if isinstance(version, bytes) else str(version)
        return Check("nvml", "ok", f"NVML reachable: driver {driver}, {count} GPU(s)")
    except Exception as e:
        return Check("nvml", "warn", f"NVML initialised but a query failed: {e}",
                     "check nvidia-smi; GPU utilisation will not be reported")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


# --- handles on the dataset --------------------------------------------------------------------------------


def db_handles_check(dataset: object, num_workers: int | None = None) -> Check:
    """Warn about database handles and open files created before the workers fork: each forked worker gets a
    copy of the same connection / file offset, which corrupts reads or deadlocks (sqlite, lmdb, h5py)."""
    try:
        found = find_handles(dataset)
    except Exception as e:  # never let a check break training
        return Check("db_handles", "info", f"could not scan the dataset's attributes: {type(e).__name__}: {e}")
    if not found:
        return Check("db_handles", "ok", f"no open database handles or files on the {type(dataset).__name__} "
                     "dataset's attributes")
    listed = "; ".join(f"{path} is {kind}" for path, kind in found)
    if num_workers == 0:
        return Check("db_handles", "info", f"{listed}: fine with num_workers=0, but it breaks once workers fork",
                     DB_FIX)
    return Check("db_handles", "warn",
                 f"{listed}, opened before the DataLoader workers fork: every worker shares the same handle, "
                 "which corrupts reads or deadlocks", DB_FIX)
