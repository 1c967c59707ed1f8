"""batches.py: a dataset read a group at a time (a remote pack's shards) is split between ranks and between each
rank's loader worker processes, so each reads only its own groups; other datasets keep their order."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from trainfast.loader.batches import EpochBatches
from trainfast.loader.make import make_loader


def shards_of(sizes: list[int], seed: int = 0) -> np.ndarray:
    """Each sample's group for groups of `sizes` samples, the samples laid out in any order."""
    groups = np.repeat(np.arange(len(sizes)), sizes)
    return groups[np.random.default_rng(seed).permutation(len(groups))]


def batches_of(s: EpochBatches) -> list[tuple[int, np.ndarray]]:
    return [(seed, idx.copy()) for seed, idx in s]


def ranks(n: int, batch: int, world: int, *, groups: np.ndarray, workers: int = 1, epoch: int = 0,
          drop_last: bool = False, shuffle: bool = True, seed: int = 3) -> list[EpochBatches]:
    """One EpochBatches per rank, each made on its own (as each rank makes its own)."""
    out = []
    for rank in range(world):
        s = EpochBatches(n, batch, shuffle=shuffle, drop_last=drop_last, seed=seed, rank=rank, world_size=world,
                         groups=groups, workers=workers)
        s.set_epoch(epoch)
        out.append(s)
    return out


CASES = [  # samples, batch size, ranks, workers, drop_last, group sizes
    (60, 4, 2, 1, False, [5] * 12),
    (61, 4, 2, 4, False, [7] * 8 + [5]),      # padding by wrapping (61 is odd)
    (100, 6, 3, 2, False, [10] * 10),
    (100, 6, 3, 2, True, [10] * 10),
    (37, 5, 4, 3, False, [1, 9, 2, 8, 3, 7, 4, 3]),
    (30, 8, 2, 4, False, [6] * 5),             # more workers than a rank has batches
]


@pytest.mark.parametrize(("n", "batch", "world", "workers", "drop_last", "sizes"), CASES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_per_epoch_across_ranks_with_equal_batch_counts(
        n: int, batch: int, world: int, workers: int, drop_last: bool, sizes: list[int], shuffle: bool) -> None:
    groups = shards_of(sizes)
    lengths = set()
    for epoch in (0, 1, 5):
        per_rank = [batches_of(s) for s in ranks(n, batch, world, groups=groups, workers=workers, epoch=epoch,
                                                  drop_last=drop_last, shuffle=shuffle)]
        counts = {len(b) for b in per_rank}
        assert len(counts) == 1  # no rank runs out first
        lengths |= counts
        per_rank_samples = -(-n // world)
        want = per_rank_samples // batch if drop_last else -(-per_rank_samples // batch)
        assert counts == {want}
        for b in per_rank:
            assert all(len(idx) == batch for _, idx in b[:-1]) and (not b or 1 <= len(b[-1][1]) <= batch)
        seen = Counter(int(i) for b in per_rank for _, idx in b for i in idx)
        if drop_last:
            assert max(seen.values()) == 1 and len(seen) == want * batch * world
        else:
            padding = per_rank_samples * world - n  # as DistributedSampler: a few samples again, to even the ranks
            assert set(seen) == set(range(n)) and sum(seen.values()) == n + padding
            assert sum(c - 1 for c in seen.values()) == padding
    assert len(lengths) == 1  # the same whatever the epoch


@pytest.mark.parametrize(("n", "batch", "world", "workers", "drop_last", "sizes"), CASES)
def test_each_rank_and_worker_reads_its_own_groups(n: int, batch: int, world: int, workers: int, drop_last: bool,
                                                    sizes: list[int]) -> None:
    """A worker's batches (w, w + workers, ... as the DataLoader deals them) share a group with another worker's or
    another rank's only at the two ends of its run; and it visits its groups a window of 2 at a time."""
    groups = shards_of(sizes, seed=1)
    readers: list[set[int]] = []
    for s in ranks(n, batch, world, groups=groups, workers=workers, epoch=2, drop_last=drop_last):
        batches = [idx for _, idx in batches_of(s)]
        for w in range(workers):
            mine = np.concatenate(batches[w::workers]) if batches[w::workers] else np.empty(0, dtype=np.int64)
            readers.append(set(groups[mine].tolist()))
            # windows: the groups in the order the worker first meets them; all of a window's samples come before
            # any of the next window's
            met = {g: k for k, g in enumerate(dict.fromkeys(groups[mine].tolist()))}
            window = [met[g] // 2 for g in groups[mine].tolist()]
            assert window == sorted(window)
    shared = Counter(g for r in readers for g in r)
    for r in readers:
        assert sum(1 for g in r if shared[g] > 1) <= 2 + (1 if n % world else 0)  # its run's ends (+ the padding)
    assert sum(len(r) for r in readers) <= len(sizes) + 2 * len(readers)  # each group read about once in all


def test_order_is_a_function_of_seed_and_epoch() -> None:
    groups = shards_of([6] * 10)
    first = [batches_of(s) for s in ranks(60, 4, 2, groups=groups, workers=2, epoch=3)]
    np.random.seed(99)  # the global RNG plays no part
    again = [batches_of(s) for s in ranks(60, 4, 2, groups=groups, workers=2, epoch=3)]
    assert all(same(a, b) for a, b in zip(first, again, strict=True))
    other_epoch = [batches_of(s) for s in ranks(60, 4, 2, groups=groups, workers=2, epoch=4)]
    other_seed = [batches_of(s) for s in ranks(60, 4, 2, groups=groups, workers=2, epoch=3, seed=4)]
    for other in (other_epoch, other_seed):
        assert not np.array_equal(flat(other[0]), flat(first[0]))
    # the worker count is part of the order (fixed for a run): another count splits the epoch differently
    four = [batches_of(s) for s in ranks(60, 4, 2, groups=groups, workers=4, epoch=3)]
    assert not np.array_equal(flat(four[0]), flat(first[0]))


@pytest.mark.parametrize("start", [1, 3, 7])
def test_resume_at_another_step_gives_the_rest_of_the_epoch(start: int) -> None:
    groups = shards_of([5] * 13)
    for s in ranks(65, 4, 2, groups=groups, workers=3, epoch=2):
        full = batches_of(s)
        s.start_at(start)
        assert same(batches_of(s), full[start:])  # the same samples and the same batch seeds
        assert same(batches_of(s), full)  # once
        fresh = EpochBatches(65, 4, shuffle=True, drop_last=False, seed=3, rank=s.rank, world_size=2, groups=groups,
                             workers=3)  # a resumed process: a new sampler, told the epoch and the step
        fresh.set_epoch(2)
        fresh.start_at(start)
        assert same(batches_of(fresh), full[start:])


def test_one_rank_one_worker_unshuffled_is_the_packed_order() -> None:
    groups = np.repeat(np.arange(5), 4)  # a pack lists its samples shard by shard
    s = EpochBatches(20, 3, shuffle=False, drop_last=False, groups=groups)
    assert np.array_equal(flat(batches_of(s)), np.arange(20))


def test_without_groups_the_order_is_unchanged() -> None:
    """The plain shuffle, as before groups were split: numpy's permutation of (seed, epoch), strided over ranks;
    the worker count plays no part."""
    for world in (1, 2, 3):
        for rank in range(world):
            for workers in (1, 4):
                s = EpochBatches(23, 4, shuffle=True, drop_last=False, seed=5, rank=rank, world_size=world,
                                 workers=workers)
                s.set_epoch(2)
                per_rank = -(-23 // world)
                want = np.resize(np.random.default_rng([5, 2]).permutation(23), per_rank * world)[rank::world]
                assert np.array_equal(flat(batches_of(s)), want)


def test_bad_worker_count() -> None:
    with pytest.raises(ValueError, match=re.escape("workers=0 is not valid; give the loader's worker processes")):
        EpochBatches(10, 2, shuffle=True, drop_last=False, workers=0)


class Grouped(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A dataset that reads its samples a group at a time (as a remote pack its shards)."""

    read_groups = np.repeat(np.arange(4), 8)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(2), index


@pytest.mark.parametrize(("workers", "backend", "split"), [(2, "processes", 2), (0, "processes", 1),
                                                           (2, "threads", 1)])
def test_make_loader_splits_groups_between_worker_processes_not_threads(workers: int, backend: Any,
                                                                       split: int) -> None:
    loader = make_loader(Grouped(), 4, workers=workers, backend=backend, device="cpu")
    assert loader.batches.workers == split and loader.batches.groups is not None  # type: ignore[union-attr]


def same(a: list[tuple[int, np.ndarray]], b: list[tuple[int, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(sa == sb and np.array_equal(ia, ib)
                                    for (sa, ia), (sb, ib) in zip(a, b, strict=True))


def flat(batches: list[tuple[int, np.ndarray]]) -> np.ndarray:
    return np.concatenate([idx for _, idx in batches]) if batches else np.empty(0, dtype=np.int64)
