"""Device strings ("auto" | "cpu" | "cuda" | "cuda:N"): validated in one place, resolved to a torch.device."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import time
from collections.abc import Mapping

import torch

from trainfast.launch import launch_env

DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def device_kind(spec: str) -> str:
    """"auto", "cpu" or "cuda" for a valid spec; ValueError naming the spec and the valid forms otherwise."""
    kind, colon, index = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind not in ("auto", "cpu", "cuda") or (colon and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"device={spec!r} is not valid; use {DEVICE_CHOICES}")
    return kind


def resolve_device(spec: str, env: Mapping[str, str] | None = None) -> torch.device:
    """The torch.device a spec names, its CUDA index filled in and checked against the visible GPUs.

    "auto" is the GPU torchrun assigned (LOCAL_RANK), else the current GPU, else the CPU. "cuda" is the current GPU,
    except under torchrun with several processes (WORLD_SIZE > 1): there it is LOCAL_RANK's GPU too, as the current
    GPU would put every rank on GPU 0. "cuda:N" is GPU N as given. `env` defaults to os.environ.
    """
    kind = device_kind(spec)
    env = os.environ if env is None else env
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={spec!r} but CUDA is not available (torch {torch.__version__}); "
                         "use device='cpu' or 'auto'")
    count = torch.cuda.device_count()
    launch = launch_env(env)
    if launch.gpu is not None and (kind == "auto" or (spec == "cuda" and launch.distributed)):
        index = launch.gpu
        if index >= count:
            raise ValueError(
                f"device={spec!r} means cuda:{index} under torchrun (LOCAL_RANK={index}), but this process sees "
                f"{count} CUDA device(s) (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}). Start at "
                f"most {count} process(es) per node (torchrun --nproc-per-node={count}) or make more GPUs visible "
                "(CUDA_VISIBLE_DEVICES); if each process is given only its own GPU, use device='cuda:0'")
        return torch.device("cuda", index)
    given = None if kind == "auto" else torch.device(spec).index
    index = torch.cuda.current_device() if given is None else given
    if index >= count:
        raise ValueError(f"device={spec!r} but only {count} CUDA device(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                         f"use an index below {count}, or 'cuda' / 'auto'")
    return torch.device("cuda", index)


def synchronize(device: torch.device | str) -> None:
    """Block until `device` has run all the work queued on it; a no-op on the CPU, whose kernels run in line.

    Call it before every clock read that starts or stops a measurement: CUDA kernels run asynchronously, so
    a clock started without it books warm-up work still queued to the measured steps, and one stopped without
    it misses measured work. The device is named, not taken as the current one: on a multi-GPU host the work
    may run on another. A device spec is resolved as `resolve_device` does ("auto": torchrun's GPU).
    """
    if isinstance(device, str):
        device = resolve_device(device) if device_kind(device) == "auto" else torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():  # without CUDA nothing can be queued there
        torch.cuda.synchronize(device)


class DeviceClock:
    """Wall time of device work: the one timer the measured steps use (the Trainer's A/Bs, the tuner's trials and
    compute rate, the batch-size search), synchronising the device when it starts and when it is read."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self.started = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.started


def free_memory(device: torch.device) -> None:
    """Give back what the last run (a bench row, a batch-size try) held: Python garbage (reference cycles, e.g.
    through a traceback, may still hold its tensors), the CUDA cache (the next run starts unfragmented), glibc's
    free heap pages (the next run's RSS growth is honest)."""
    gc.collect()
    synchronize(device)  # the last row's kernels still hold their memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _malloc_trim()


def _malloc_trim() -> None:
    """glibc keeps freed heap pages in the process; returning them makes the next row's RSS growth honest."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        name = ctypes.util.find_library("c")
        if name:
            ctypes.CDLL(name).malloc_trim(0)
