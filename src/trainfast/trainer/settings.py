"""Global torch settings the Trainer may change, only when asked, and always puts back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_settings(*, cpu_threads: int | None, cudnn_benchmark: bool | None) -> Iterator[None]:
    """Set intra-op threads and `cudnn.benchmark` for a block (None leaves a setting alone)."""
    threads, benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
