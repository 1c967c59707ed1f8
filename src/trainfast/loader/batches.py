"""The batch order of an epoch: which sample indices form each batch, and each batch's seed."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import torch

from trainfast.loader.seeding import derive_seed


class EpochBatches(torch.utils.data.Sampler[tuple[int, np.ndarray]]):
    """Yields `(batch_seed, indices)` for one epoch; the order is a function of (seed, epoch) only.

    With `world_size > 1` each rank takes every `world_size`-th sample of the shuffled order, padded
    by wrapping around so every rank has the same number of batches (as `DistributedSampler`).
    `start_at(b)` makes the next epoch begin at batch `b`: resuming mid-epoch costs nothing, no
    batch is fetched only to be thrown away.

    `groups` (each sample's group, e.g. the shard holding it): a shuffled epoch visits the groups in a shuffled
    order, `window` at a time, its samples shuffled within each window (WebDataset's shard shuffle), so a dataset
    that reads a whole group at once (remote shards) holds only a few at a time and reads each once an epoch.
    """

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0,
                 rank: int = 0, world_size: int = 1, groups: np.ndarray | None = None, window: int = 2) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is not valid; use a positive integer")
        if world_size < 1:
            raise ValueError(f"world_size={world_size} is not valid; use a positive integer")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}; valid ranks are 0..{world_size - 1}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.rank, self.world_size = rank, world_size
        if groups is not None and len(groups) != num_samples:
            raise ValueError(f"groups has {len(groups)} entries for {num_samples} samples; give one per sample")
        if window < 1:
            raise ValueError(f"window={window} is not valid; use a positive integer")
        self.groups, self.window = groups, window
        self.epoch = 0
        self._start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, batch: int) -> None:
        """Skip the first `batch` batches of the next epoch iterated (once)."""
        if not 0 <= batch <= len(self):
            raise ValueError(f"start batch {batch} is outside the epoch's {len(self)} batches")
        self._start = batch

    def for_epoch(self, epoch: int) -> EpochBatches:
        """A copy yielding `epoch` from its first batch; this one keeps its own epoch and start point."""
        other = copy.copy(self)
        other.epoch, other._start = epoch, 0
        return other

    def _per_rank(self) -> int:
        return -(-self.num_samples // self.world_size)

    def __len__(self) -> int:
        n = self._per_rank()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for b, indices in self.indices():
            yield derive_seed(self.seed, self.epoch, self.rank, b), indices

    def indices(self) -> Iterator[tuple[int, np.ndarray]]:
        """(batch number, sample indices) for this epoch, without seeds (for loaders with no randomness)."""
        if self.shuffle and self.groups is not None:
            order = self._windowed(np.random.default_rng([self.seed, self.epoch]), self.groups)
        elif self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        if self.world_size > 1:
            total = self._per_rank() * self.world_size
            order = np.resize(order, total)[self.rank::self.world_size]  # np.resize wraps around
        start, self._start = self._start, 0
        for b in range(start, len(self)):
            yield b, order[b * self.batch_size:(b + 1) * self.batch_size]


    def _windowed(self, rng: np.random.Generator, groups: np.ndarray) -> np.ndarray:
        """The groups in a shuffled order, `window` at a time, each window's samples shuffled."""
        names, of_sample = np.unique(groups, return_inverse=True)
        visit = rng.permutation(len(names))
        rank_of = np.empty_like(visit)
        rank_of[visit] = np.arange(len(visit))  # each group's place in the visit order
        # sort by (window, a random key): windows in order, samples shuffled inside each
        window_of = rank_of[of_sample] // self.window
        return np.lexsort((rng.random(len(groups)), window_of))


class EpochLoader:
    """What `Loader` and `TensorLoader` share: every iteration is the next epoch unless `set_epoch` says
    otherwise (so a plain `for epoch: for batch in loader` loop reshuffles), and `start_at` for resume."""

    batches: EpochBatches
    _next_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    def start_at(self, batch: int) -> None:
        self.batches.start_at(batch)

    def __len__(self) -> int:
        return len(self.batches)

    def _begin_epoch(self) -> None:
        self.batches.set_epoch(self._next_epoch)
        self._next_epoch += 1
