"""How many samples a batch holds: the one rule used by the Trainer, the tuner and the doctor.

A batch is whatever a loader yields: a tensor, `(inputs, targets)`, a Hugging Face style dict
(`{"input_ids": ..., "attention_mask": ..., "labels": ...}`), a dataclass instance (a `collate_fn` returning
`Batch(images=..., labels=...)`) or any nesting of tuples, lists, Mappings and dataclasses. Its samples are the
leading dimension of its first tensor (or numpy array) leaf, found depth first, Mappings in their iteration
(insertion) order, dataclasses in field order. Other objects (strings, numbers) are not looked into. One
exception: a list of same-rank tensors that differ in their first dimension only (point clouds, variable-length
sequences left unpadded) is one sample per tensor, so the list's length is the count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch


def first_leaf(batch: Any) -> torch.Tensor | np.ndarray | None:
    """The first tensor (or numpy array) in a batch of tuples, lists, Mappings and dataclasses, depth first,
    Mappings and dataclass fields in order; None when it holds none."""
    return _first(batch)[0]


def _first(batch: Any) -> tuple[torch.Tensor | np.ndarray | None, int | None]:
    """The first leaf, and the length of the ragged list of tensors holding it, if it is in one: one walk."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch, None
    if _ragged(batch):
        return batch[0], len(batch)
    for child in _children(batch):
        leaf, ragged = _first(child)
        if leaf is not None:
            return leaf, ragged
    return None, None


def _children(batch: Any) -> Iterable[Any]:
    """What a batch container holds, in order; nothing for anything else."""
    # called for every batch the doctor sees: tuples first, the (slow, ~0.3 us) Mapping ABC check last
    if isinstance(batch, (tuple, list)):
        return batch
    if isinstance(batch, (dict, Mapping)):
        return batch.values()
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return (getattr(batch, f.name, None) for f in dataclasses.fields(batch))
    return ()


def batch_samples(batch: Any, default: int = 1) -> int:
    """Samples in a batch: the leading dimension of its first tensor leaf (`(x, y)`, `{"input_ids": ...}`,
    nested ones alike), or the length of a ragged list of tensors holding it; `default` when it holds no tensor,
    or its first one is 0-dimensional."""
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor:  # most batches: 4x faster
        if _ragged(batch):
            return len(batch)
        leaf: torch.Tensor | np.ndarray | None = batch[0]
    else:
        leaf, ragged = _first(batch)
        if ragged is not None:
            return ragged
    if leaf is None:
        return default
    shape = leaf.shape
    return int(shape[0]) if len(shape) else default


def _ragged(items: Any) -> bool:
    """A list of 2+ tensors of one rank whose shapes differ in the first dimension only: one sample each. (A
    `(x, lengths)` pair has two ranks; `(x, y)` from `default_collate` shares the first dimension.)"""
    if not isinstance(items, list) or len(items) < 2 or not isinstance(items[0], torch.Tensor):
        return False
    first, second = items[0], items[1]
    if not isinstance(second, torch.Tensor) or second.ndim != first.ndim:  # (x, y) as default_collate gives it
        return False
    if first.ndim == 0 or not all(isinstance(t, torch.Tensor) and t.ndim == first.ndim
                                  and t.shape[1:] == first.shape[1:] for t in items):
        return False
    return any(t.shape[0] != first.shape[0] for t in items)
