"""What the doctor reads off a loader it times: its settings (`describe_loader`) and a batch's size and image shape
(`batch_info`), for DataLoaders, trainfast's Loader (its inner DataLoader) and TensorLoader."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Subset, TensorDataset

from trainfast.diagnose.records.steps import LoaderStats
from trainfast.loader.memory import TensorLoader
from trainfast.loader.threads import ThreadLoader
from trainfast.samples import first_leaf


def batch_info(batch: Any) -> tuple[int, tuple[int, int] | None]:
    """(bytes, (H, W) of a 4-D first tensor) of a batch of tensors nested in tuples/lists/dicts/dataclasses."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif is_dataclass(x) and not isinstance(x, type):
            for f in fields(x):
                walk(getattr(x, f.name, None))

    walk(batch)
    first = first_leaf(batch)
    hw = (int(first.shape[-2]), int(first.shape[-1])) if first is not None and first.ndim == 4 else None
    return sum(t.numel() * t.element_size() for t in tensors), hw


def describe_loader(loader: Any, index: int) -> LoaderStats:
    """Settings of a torch DataLoader, a trainfast Loader's inner DataLoader, a ThreadLoader or a TensorLoader."""
    try:
        per_epoch: int | None = len(loader)
    except TypeError:  # an IterableDataset without __len__
        per_epoch = None
    if isinstance(loader, TensorLoader):
        return LoaderStats(index=index, kind="trainfast TensorLoader", dataset="tensors in memory", num_workers=0,
                           pin_memory=loader.pin_memory, persistent_workers=False, prefetch_factor=None,
                           batch_size=loader.batch_size, in_memory=True, decode=None, batches_per_epoch=per_epoch)
    if isinstance(loader, ThreadLoader):
        return LoaderStats(index=index, kind="trainfast ThreadLoader (threads)", dataset=_dataset_name(loader.dataset),
                           num_workers=loader.threads, pin_memory=loader.pin_memory, persistent_workers=False,
                           prefetch_factor=loader.prefetch_factor, batch_size=loader.batch_size,
                           in_memory=_tensors_in_memory(loader.dataset), decode=getattr(loader.dataset, "decode", None),
                           batches_per_epoch=per_epoch)
    dataset = loader.dataset
    kind, batch_size = "DataLoader", loader.batch_size
    inner = getattr(dataset, "dataset", None)
    if type(dataset).__name__ == "_SeededBatches" and inner is not None:  # make_loader's wrapper
        kind, dataset = "trainfast Loader", inner
        batch_size = getattr(loader.sampler, "batch_size", None)
    workers = loader.num_workers
    context = loader.multiprocessing_context
    return LoaderStats(
        index=index, kind=kind + (f" ({context.get_start_method()})" if workers and context else ""),
        dataset=_dataset_name(dataset), num_workers=workers, pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor if workers else None,
        batch_size=batch_size, in_memory=_tensors_in_memory(dataset), decode=getattr(dataset, "decode", None),
        batches_per_epoch=per_epoch)


def _dataset_name(dataset: Any) -> str:
    """`TensorDataset`, or `Subset of TensorDataset` for a `random_split` part (the usual train/val split)."""
    if isinstance(dataset, Subset):
        return f"Subset of {_dataset_name(dataset.dataset)}"
    return type(dataset).__name__


def _tensors_in_memory(dataset: Any) -> bool:
    """A `TensorDataset`, or subsets and concatenations of them: samples are rows of tensors in RAM."""
    if isinstance(dataset, Subset):
        return _tensors_in_memory(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return all(_tensors_in_memory(part) for part in dataset.datasets)
    return isinstance(dataset, TensorDataset)
