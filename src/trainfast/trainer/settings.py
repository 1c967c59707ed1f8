"""Global torch settings the Trainer may change, only when asked, and always puts back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_settings(*, cpu_threads: int | None = None, cudnn_benchmark: bool | None = None,
                   tf32: bool = False) -> Iterator[None]:
    """Intra-op threads, `cudnn.benchmark` and TF32 for a block (None / False leave a setting alone)."""
    saved = (torch.get_num_threads(), torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),
             torch.backends.cudnn.allow_tf32)
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    if tf32:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        threads, benchmark, matmul, cudnn_tf32 = saved
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
