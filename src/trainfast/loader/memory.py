"""The in-memory path: tensors already in RAM (or on the device) batched by indexing whole index arrays.

A `DataLoader` over a `TensorDataset` calls `__getitem__` once per sample and then collates the
pieces with `torch.stack`: for 64 small samples that is ~64 Python calls and 64 tiny tensors per
batch. One `tensor[index_array]` gather does the same work in a single kernel (benchmarks/in_memory.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from trainfast.loader.auto import LoaderPlan
from trainfast.loader.batches import EpochBatches, EpochLoader
from trainfast.loader.prefetch import Normalize


class TensorLoader(EpochLoader):
    """Batches of `tensors` (all with the same first dimension), in `EpochBatches` order.

    Tensors may live on any device: each batch is gathered where its tensor is, with the batch's index copied
    there once. `pin_memory` applies to the tensors in host memory only; `pin_memory` afterwards says whether
    any batch piece is pinned.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], batch_size: int, *, shuffle: bool = True,
                 drop_last: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1,
                 pin_memory: bool = False, normalize: Normalize | None = None,
                 plan: LoaderPlan | None = None) -> None:
        if not tensors:
            raise ValueError("TensorLoader needs at least one tensor")
        n = tensors[0].shape[0]
        sizes = [t.shape[0] for t in tensors]
        if any(s != n for s in sizes):
            raise ValueError(f"tensors disagree on their first dimension: {sizes}; they must all have {n} rows")
        self.tensors = tuple(tensors)
        self.batches = EpochBatches(n, batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed,
                                    rank=rank, world_size=world_size)
        # Only host memory can be page-locked: pinning a device tensor is an error, and it is already there.
        self._pin = tuple(pin_memory and t.device.type == "cpu" for t in self.tensors)
        self.batch_size, self.pin_memory, self.normalize = batch_size, any(self._pin), normalize
        self._devices = tuple(dict.fromkeys(t.device for t in self.tensors))  # each once, in order
        self.plan = plan

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self._begin_epoch()
        contiguous = not self.batches.shuffle and self.batches.world_size == 1
        for _, idx in self.batches.indices():
            if contiguous:  # plain slices are views: no gather at all
                batch = tuple(t[int(idx[0]):int(idx[-1]) + 1] for t in self.tensors)
            else:
                # index_select, not t[index]: advanced indexing is ~15x slower here (105 vs 7 us for
                # 128 CIFAR-sized uint8 rows)
                index = {device: index_on(idx, device) for device in self._devices}
                batch = tuple(t.index_select(0, index[t.device]) for t in self.tensors)
            yield tuple(b.pin_memory() if pin else b for b, pin in zip(batch, self._pin, strict=True)) \
                if self.pin_memory else batch


def index_on(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    """The batch's sample indices as a tensor on `device`, where the gather runs (one small copy per batch)."""
    index = torch.from_numpy(idx)
    if device.type == "cpu":
        return index
    if device.type == "cuda":
        # From page-locked memory the copy is only queued: a blocking copy, or one from pageable memory, may
        # wait for every kernel already queued, stalling the host once per batch.
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)
