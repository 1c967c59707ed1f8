"""Out-of-memory errors: recognising one, the allocator's state when it happened, and whether fragmentation
(free cached blocks too small for the request) rather than a lack of memory caused it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from trainfast.units import format_bytes, to_bytes

# Cached-but-unallocated memory at an OOM above this share of the reserved memory means the allocator
# held free blocks it could not use for the request: fragmentation (the same hint torch's OOM text gives).
FRAGMENTATION_SHARE = 0.25
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# Messages of allocation failures that torch does not raise as OutOfMemoryError: the CPU allocator,
# older CUDA paths and cuBLAS failing to allocate its workspace.
_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "cublas_status_alloc_failed")
_REQUEST = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB|TiB)")


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory at an out-of-memory error, in bytes."""

    allocated: int  # held by live tensors
    reserved: int  # held by torch's caching allocator (allocated + cached free blocks)
    total: int  # the device's capacity


def is_oom(error: BaseException) -> bool:
    """An allocation failure, as opposed to a bug."""
    if isinstance(error, torch.OutOfMemoryError):  # torch.cuda.OutOfMemoryError is this class
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _OOM_MARKERS)


def fragmented(memory: MemorySnapshot, requested: int | None) -> bool:
    """Was the OOM caused by cached blocks too fragmented to serve the request, not by a lack of memory?"""
    cached = memory.reserved - memory.allocated
    if memory.reserved <= 0 or cached <= FRAGMENTATION_SHARE * memory.reserved:
        return False
    # A request larger than everything live tensors leave free fails however the memory is laid out.
    return requested is None or requested <= memory.total - memory.allocated


def memory_at_oom(device: torch.device) -> MemorySnapshot | None:
    """The CUDA allocator's numbers (None elsewhere): read while the failed step's tensors are still alive."""
    if device.type != "cuda":
        return None
    return MemorySnapshot(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                          total=torch.cuda.get_device_properties(device).total_memory)


def requested_bytes(message: str) -> int | None:
    """The failed allocation's size, from torch's CUDA or CPU OOM message."""
    if match := _REQUEST.search(message):
        return to_bytes(float(match.group(1)), match.group(2))
    return None


def first_line(error: BaseException) -> str:
    """The error's first line: torch appends pages of allocator hints to a CUDA OOM message."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def advice(error: BaseException, memory: MemorySnapshot | None) -> str:
    """What the allocator held at the error and what to change, for the message of an OOM in training."""
    lines = []
    if memory is not None:
        lines.append(f"{format_bytes(memory.allocated)} allocated by tensors, {format_bytes(memory.reserved)} "
                     f"reserved by torch, of {format_bytes(memory.total)}")
        if fragmented(memory, requested_bytes(str(error))):
            lines.append(fragmentation_advice(memory))
    lines.append("a smaller batch (trainfast.find_batch_size(model, sample) measures the largest that fits; "
                 "TrainConfig(accumulate=N) keeps the effective batch), mixed precision (precision='bf16-mixed' "
                 "or 'auto') or a smaller model")
    return "; ".join(lines)


def fragmentation_advice(memory: MemorySnapshot) -> str:
    """The one advice for a fragmented allocator cache (training's OOM and `find_batch_size` alike): what is cached
    but unusable, and the fix, given what PYTORCH_CUDA_ALLOC_CONF already sets."""
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        fix = ("PYTORCH_CUDA_ALLOC_CONF already sets expandable_segments, so the cached blocks are pinned by live "
               "tensors: free long-lived tensors made during training, or call torch.cuda.empty_cache()")
    else:
        fix = (f"set {EXPANDABLE} in the environment before the process starts: the allocator then grows segments "
               "instead of splitting fixed ones")
    return (f"fragmentation: {format_bytes(memory.reserved - memory.allocated)} of the {format_bytes(memory.reserved)}"
            f" torch reserved was cached but in blocks too small for the request (device total "
            f"{format_bytes(memory.total)}); {fix}")
