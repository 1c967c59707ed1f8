"""batches.py: `EpochBatches`, the per-epoch batch order and per-batch seeds."""

from __future__ import annotations

import re

import numpy as np
import pytest

from trainfast.loader.batches import EpochBatches


def epoch(sampler: EpochBatches) -> list[tuple[int, np.ndarray]]:
    return [(seed, idx.copy()) for seed, idx in sampler]


def indices(sampler: EpochBatches) -> list[np.ndarray]:
    return [idx for _, idx in epoch(sampler)]


def same(a: list[tuple[int, np.ndarray]], b: list[tuple[int, np.ndarray]]) -> bool:
    return len(a) == len(b) and all(sa == sb and np.array_equal(ia, ib)
                                    for (sa, ia), (sb, ib) in zip(a, b, strict=True))


def test_order_depends_only_on_seed_and_epoch() -> None:
    a = EpochBatches(50, 8, shuffle=True, drop_last=False, seed=7)
    b = EpochBatches(50, 8, shuffle=True, drop_last=False, seed=7)
    first = epoch(a)
    np.random.seed(123)  # the global RNG plays no part
    assert same(epoch(b), first)
    assert same(epoch(a), first)  # iterating again without set_epoch: the same epoch
    a.set_epoch(1)
    second = epoch(a)
    assert not np.array_equal(np.concatenate([i for _, i in second]), np.concatenate([i for _, i in first]))
    b.set_epoch(1)
    assert same(epoch(b), second)
    a.set_epoch(0)
    assert same(epoch(a), first)
    other_seed = EpochBatches(50, 8, shuffle=True, drop_last=False, seed=8)
    assert not np.array_equal(np.concatenate(indices(other_seed)), np.concatenate([i for _, i in first]))


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffled_epoch_is_a_permutation(drop_last: bool) -> None:
    s = EpochBatches(50, 8, shuffle=True, drop_last=drop_last, seed=1)
    flat = np.concatenate(indices(s))
    assert len(flat) == (48 if drop_last else 50)
    assert len(set(flat.tolist())) == len(flat)
    assert set(flat.tolist()) <= set(range(50))
    assert not np.array_equal(flat, np.arange(len(flat)))


@pytest.mark.parametrize("epoch_number", [0, 3])
def test_no_shuffle_is_arange(epoch_number: int) -> None:
    s = EpochBatches(10, 4, shuffle=False, drop_last=False, seed=5)
    s.set_epoch(epoch_number)
    got = indices(s)
    assert [i.tolist() for i in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize(("n", "batch", "world", "drop_last", "expected"), [
    (10, 3, 1, False, 4),
    (10, 3, 1, True, 3),
    (9, 3, 1, False, 3),
    (9, 3, 1, True, 3),
    (2, 3, 1, False, 1),
    (2, 3, 1, True, 0),
    (0, 3, 1, False, 0),
    (10, 2, 3, False, 2),   # 4 samples per rank
    (10, 3, 3, False, 2),
    (10, 3, 3, True, 1),
    (11, 4, 2, True, 1),    # 6 per rank
    (11, 4, 2, False, 2),
    (1, 1, 4, False, 1),    # more ranks than samples: padded by wrapping
])
def test_len(n: int, batch: int, world: int, drop_last: bool, expected: int) -> None:
    for rank in range(world):
        for shuffle in (False, True):
            s = EpochBatches(n, batch, shuffle=shuffle, drop_last=drop_last, rank=rank, world_size=world)
            assert len(s) == expected
            got = indices(s)
            assert len(got) == expected
            per_rank = -(-n // world)
            for i, idx in enumerate(got):
                full = i < len(got) - 1 or drop_last
                assert len(idx) == batch if full else 1 <= len(idx) <= batch
            if not drop_last:
                assert sum(len(i) for i in got) == per_rank


@pytest.mark.parametrize("n", [7, 10, 11, 12])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_cover_every_sample_with_equal_batch_counts(n: int, world: int, shuffle: bool) -> None:
    ranks = [EpochBatches(n, 2, shuffle=shuffle, drop_last=False, seed=3, rank=r, world_size=world)
             for r in range(world)]
    for s in ranks:
        s.set_epoch(2)
    per_rank = [np.concatenate(indices(s)) for s in ranks]
    assert len({len(s) for s in ranks}) == 1
    assert len({len(indices(s)) for s in ranks}) == 1
    assert {len(p) for p in per_rank} == {-(-n // world)}
    union = np.concatenate(per_rank)
    assert set(union.tolist()) == set(range(n))
    # only the wrap-around padding repeats samples
    assert len(union) - len(set(union.tolist())) == len(union) - n


def test_start_at_skips_batches_once() -> None:
    s = EpochBatches(30, 4, shuffle=True, drop_last=False, seed=11)
    full = epoch(s)
    assert len(full) == 8
    s.start_at(3)
    resumed = epoch(s)
    assert same(resumed, full[3:])  # same indices and the same batch seeds
    assert same(epoch(s), full)     # the following iteration starts at 0 again
    s.start_at(2)
    s.set_epoch(1)  # start_at applies to whichever epoch is iterated next
    assert same(epoch(s), _epoch_of(30, 4, 11, 1)[2:])
    assert same(epoch(s), _epoch_of(30, 4, 11, 1))


def _epoch_of(n: int, batch: int, seed: int, e: int) -> list[tuple[int, np.ndarray]]:
    s = EpochBatches(n, batch, shuffle=True, drop_last=False, seed=seed)
    s.set_epoch(e)
    return epoch(s)


def test_indices_match_iteration_without_seeds() -> None:
    s = EpochBatches(30, 4, shuffle=True, drop_last=False, seed=2, rank=1, world_size=2)
    s.set_epoch(3)
    with_seeds = epoch(s)
    plain = [(b, idx.copy()) for b, idx in s.indices()]
    assert [b for b, _ in plain] == list(range(len(s)))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(plain, with_seeds, strict=True))
    assert len(s) == 4
    s.start_at(2)
    assert [b for b, _ in s.indices()] == [2, 3]  # start_at applies to indices() too, once
    assert [b for b, _ in s.indices()] == list(range(len(s)))


@pytest.mark.parametrize("start", [0, 1, 7, 8])
def test_start_at_bounds(start: int) -> None:
    s = EpochBatches(30, 4, shuffle=False, drop_last=False)
    s.start_at(start)
    got = indices(s)
    assert len(got) == len(s) - start
    if got:
        assert got[0][0] == start * 4


@pytest.mark.parametrize(("start", "batches", "drop_last"),
                         [(-1, 8, False), (9, 8, False), (8, 7, True), (100, 8, False)])
def test_start_at_out_of_range(start: int, batches: int, drop_last: bool) -> None:
    s = EpochBatches(30, 4, shuffle=False, drop_last=drop_last)
    with pytest.raises(ValueError, match=re.escape(f"start batch {start} is outside the epoch's {batches} batches")):
        s.start_at(start)
    assert len(indices(s)) == batches  # a refused start_at changes nothing


def test_batch_seeds_distinct_across_batches_epochs_and_ranks() -> None:
    seeds = []
    for rank in range(3):
        for e in range(4):
            s = EpochBatches(40, 4, shuffle=True, drop_last=False, seed=0, rank=rank, world_size=3)
            s.set_epoch(e)
            seeds += [seed for seed, _ in s]
    assert len(seeds) == 3 * 4 * 4
    assert len(set(seeds)) == len(seeds)
    assert all(isinstance(x, int) and 0 <= x < 2**63 for x in seeds)


def test_batch_seeds_depend_on_the_run_seed() -> None:
    a = [seed for seed, _ in EpochBatches(20, 4, shuffle=False, drop_last=False, seed=0)]
    b = [seed for seed, _ in EpochBatches(20, 4, shuffle=False, drop_last=False, seed=1)]
    assert not set(a) & set(b)


@pytest.mark.parametrize("batch_size", [0, -1, -64])
def test_bad_batch_size(batch_size: int) -> None:
    with pytest.raises(ValueError, match=re.escape(f"batch_size={batch_size} is not valid; use a positive integer")):
        EpochBatches(10, batch_size, shuffle=True, drop_last=False)


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (5, 3)])
def test_bad_rank(rank: int, world: int) -> None:
    message = f"rank={rank} is outside world_size={world}; valid ranks are 0..{world - 1}"
    with pytest.raises(ValueError, match=re.escape(message)):
        EpochBatches(10, 2, shuffle=True, drop_last=False, rank=rank, world_size=world)


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match=re.escape("world_size=0 is not valid; use a positive integer")):
        EpochBatches(10, 2, shuffle=True, drop_last=False, rank=0, world_size=0)


def test_grouped_samples_are_visited_a_window_of_groups_at_a_time() -> None:
    groups = np.repeat(np.arange(6), 5)[np.random.default_rng(1).permutation(30)]  # 6 shards of 5, any layout
    batches = EpochBatches(30, 5, shuffle=True, drop_last=False, seed=7, groups=groups, window=2)
    order = np.concatenate([indices for _, indices in batches.indices()])
    assert sorted(order.tolist()) == list(range(30))  # every sample once
    windows = [set(groups[order[w * 10:(w + 1) * 10]].tolist()) for w in range(3)]
    assert all(len(w) == 2 for w in windows) and set().union(*windows) == set(range(6))  # 2 groups each, all seen
    again = np.concatenate([indices for _, indices in batches.indices()])
    assert np.array_equal(order, again)  # a function of (seed, epoch): resumable
    batches.set_epoch(1)
    assert not np.array_equal(order, np.concatenate([indices for _, indices in batches.indices()]))
    with pytest.raises(ValueError, match="one per sample"):
        EpochBatches(30, 5, shuffle=True, drop_last=False, groups=groups[:10])
