"""The batch order of an epoch: which sample indices form each batch, and each batch's seed."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import torch

from trainfast.loader.seeding import derive_seed


class EpochBatches(torch.utils.data.Sampler[tuple[int, np.ndarray]]):
    """Yields `(batch_seed, indices)` for one epoch; the order is a function of (seed, epoch) only.

    Without `groups`, with `world_size > 1` each rank takes every `world_size`-th sample of the shuffled order, padded
    by wrapping around so every rank has the same number of batches (as `DistributedSampler`).
    `start_at(b)` makes the next epoch begin at batch `b`: resuming mid-epoch costs nothing, no
    batch is fetched only to be thrown away.

    `groups` (each sample's group, e.g. the shard holding it) is for a dataset that reads a whole group at once
    (remote shards): each rank, and each of its `workers` loader processes, then reads only its own groups
    (WebDataset's split by node and by worker). The epoch visits the groups in an order shuffled from (seed,
    epoch); every rank takes a contiguous run of `ceil(num_samples / world_size)` samples of that sequence (the last
    padded by wrapping around; a group at a boundary is split between two ranks), and splits its run again into
    `workers` contiguous runs, one per loader process: the DataLoader deals batches round-robin, so worker `w` makes
    batches `w, w + workers, ...`, which are drawn from its run in turn. Within a run the samples are shuffled
    `window` groups at a time (WebDataset's shard shuffle), so a process holds a few groups at a time and fetches each
    whole once an epoch, plus the at most two its run shares with a neighbour: with N ranks the storage serves the
    data about once an epoch, not N times. The order then also depends on `workers` (and rank, world size), fixed
    for a run: a run resumed with another number of worker processes reads another order from its resume point on.
    Every rank computes the same global assignment without communicating. Unshuffled, the groups keep their order.
    """

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0,
                 rank: int = 0, world_size: int = 1, groups: np.ndarray | None = None, window: int = 2,
                 workers: int = 1) -> None:
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
        if workers < 1:
            raise ValueError(f"workers={workers} is not valid; give the loader's worker processes, 1 for none")
        self.groups, self.window, self.workers = groups, window, workers
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
        if self.groups is not None:
            order = self._grouped(self.groups)
        else:
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            if self.world_size > 1:
                total = self._per_rank() * self.world_size
                order = np.resize(order, total)[self.rank::self.world_size]  # np.resize wraps around
        start, self._start = self._start, 0
        for b in range(start, len(self)):
            yield b, order[b * self.batch_size:(b + 1) * self.batch_size]

    def _grouped(self, groups: np.ndarray) -> np.ndarray:
        """This rank's samples in batch order: its run of the epoch's group sequence, split between the workers."""
        per_rank, batch, workers = self._per_rank(), self.batch_size, self.workers
        count = len(self)
        if count == 0:
            return np.empty(0, dtype=np.int64)
        _, of_sample = np.unique(groups, return_inverse=True)
        of_sample = of_sample.reshape(-1)
        rng = np.random.default_rng([self.seed, self.epoch]) if self.shuffle else None
        if rng is not None:
            visit = rng.permutation(int(of_sample.max()) + 1)
            place = np.empty_like(visit)
            place[visit] = np.arange(len(visit))  # each group's place in the visit order
            # groups in visit order, each one's samples shuffled (so a group split at a boundary is split at random)
            sequence = np.lexsort((rng.random(self.num_samples), place[of_sample]))
            keys = rng.random(per_rank * self.world_size)[self.rank * per_rank:(self.rank + 1) * per_rank]
        else:
            sequence = np.argsort(of_sample, kind="stable")
        run = np.resize(sequence, per_rank * self.world_size)[self.rank * per_rank:(self.rank + 1) * per_rank]
        # the samples of each batch: full batches but the last (without drop_last); worker w makes w, w + workers, ...
        sizes = np.full(count, batch, dtype=np.int64)
        sizes[-1] = per_rank - (count - 1) * batch if not self.drop_last else batch
        taken = np.array([sizes[w::workers].sum() for w in range(workers)], dtype=np.int64)
        begins = np.concatenate(([0], np.cumsum(taken)[:-1]))  # each worker's run within this rank's
        if rng is not None:
            worker = np.repeat(np.arange(workers), taken)
            run = run[:len(worker)]  # drop_last leaves the run's tail out
            grouped = of_sample[run]
            new = np.ones(len(run), dtype=bool)  # a group begins here (the same group again in the next run: anew)
            new[1:] = grouped[1:] != grouped[:-1]
            new[begins[taken > 0]] = True
            ordinal = np.cumsum(new) - 1
            first = np.append(ordinal, 0)[begins]  # each run's first group (a worker with no batches: none)
            window = (ordinal - first[worker]) // self.window
            run = run[np.lexsort((keys[:len(run)], window, worker))]  # shuffled within each window of each run
        position = np.arange(int(sizes.sum()))
        b, j = position // batch, position % batch
        order: np.ndarray = run[begins[b % workers] + (b // workers) * batch + j]
        return order


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
