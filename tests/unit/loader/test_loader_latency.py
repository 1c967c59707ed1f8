"""latency.py: `backend="auto"` gives reads that wait on I/O a pool of loader threads (sized by Little's law, growing
while the training waits) and keeps the CPU-sized plan for reads that use the CPU; `fetch_stats`; the probe leaves
the RNG streams alone and survives a failing dataset."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from helpers import Draws, assert_same
from trainfast.envcheck.environment import preflight
from trainfast.loader import Loader, LoaderOptions, ThreadLoader, make_loader, resolve_loader
from trainfast.loader.auto import split_cpu, training_threads
from trainfast.loader.latency import MAX_THREADS, FetchStats, PoolGrowth, ReadProbe, probe_reads, size_pool

READ_S = 0.005  # a read's wait: ~9 probed reads cost ~45 ms


class Waiting(Draws):
    """Sample i: [i, a torch draw from the batch's generator], after `wait_s` of sleep (a network read's latency)."""

    def __init__(self, n: int = 2000, wait_s: float = READ_S) -> None:
        super().__init__(n, ("torch",), dtype=torch.float64, per_batch=True)
        self.wait_s = wait_s

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        return super().__getitem__(i)


class Working(Dataset[torch.Tensor]):
    """Reads that keep the CPU busy for `work_s` each (a decode)."""

    def __init__(self, n: int = 2000, work_s: float = 0.001) -> None:
        self.n, self.work_s = n, work_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = time.thread_time()
        while time.thread_time() - start < self.work_s:
            pass
        return torch.tensor([float(i)])


class GlobalDraws(Waiting):
    """Draws from the process-global RNGs, as a careless augmentation does."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.random(), float(np.random.rand()), float(torch.rand(()))])


class Failing(Waiting):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            raise OSError("connection reset")
        return super().__getitem__(i)


def epoch(loader: Any) -> list[torch.Tensor]:
    """One epoch's batches, the loader closed after (its threads would go on making the next epoch's first ones)."""
    batches = list(loader)
    loader.close()
    return batches


def test_reads_that_wait_get_a_pool_of_threads_with_its_reasons() -> None:
    loader = make_loader(Waiting(), 8, device="cpu")
    assert isinstance(loader, ThreadLoader)
    plan, today = loader.plan, split_cpu(2)[0]
    cores = plan.loader_cores
    assert plan.backend == "threads" and cores is not None and cores >= 1
    assert cores < plan.num_workers <= MAX_THREADS and plan.num_workers > today
    assert plan.prefetch_factor == 2 and not plan.persistent_workers
    text = plan.describe()
    assert f"num_workers={plan.num_workers}: reads wait" in text and "Little's law" in text
    assert "128 B a batch" in text  # 8 samples of 2 float64: the bound in bytes
    assert f"backend=threads: {plan.num_workers} loader thread(s)" in text
    assert len(epoch(loader)) == 2000 // 8
    # the training's intra-op threads take the cores the waiting threads leave, not 1 for 64 "workers"
    assert training_threads(plan, plan.num_workers, 8, False)[0] == 8 - cores
    checks = {c.name: c for c in preflight(loader)}
    assert checks["cpu"].status == "ok" and "do not pass through it" in checks["shm"].detail
    loader.close()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_reads_that_use_the_cpu_keep_today_s_plan(device: str) -> None:
    auto = resolve_loader(Working(), 32, LoaderOptions(device=device)).plan
    processes = resolve_loader(Working(), 32, LoaderOptions(device=device, backend="processes")).plan
    assert replace(auto, reasons=()) == replace(processes, reasons=())
    assert auto.backend == "processes" and auto.loader_cores is None and auto.most_threads is None
    assert auto.reasons[:-1] == processes.reasons
    assert auto.reasons[-1].startswith("backend=processes: reads use the CPU")


def test_processes_and_given_workers_are_kept_for_reads_that_wait() -> None:
    explicit = make_loader(Waiting(), 8, device="cpu", backend="processes")
    assert isinstance(explicit, Loader) and explicit.plan.num_workers == split_cpu(2)[0]
    assert "reads" not in explicit.plan.describe()  # not even timed
    given = make_loader(Waiting(), 8, device="cpu", workers=2)
    assert isinstance(given, Loader) and given.plan.num_workers == 2 and given.plan.backend == "processes"


def test_backend_threads_with_auto_workers_sizes_the_pool_too() -> None:
    loader = make_loader(Waiting(), 8, device="cpu", backend="threads")
    assert isinstance(loader, ThreadLoader) and loader.plan.num_workers > split_cpu(2)[0]
    busy = make_loader(Working(), 8, device="cpu", backend="threads")
    assert isinstance(busy, ThreadLoader) and busy.plan.num_workers == split_cpu(2)[0]


def test_the_probe_leaves_the_rng_streams_and_survives_a_failing_dataset() -> None:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(()))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    probe = probe_reads(GlobalDraws(), 2000)
    assert probe is not None and probe.reads >= 1 and probe.sample_bytes == 4 * 4
    assert (random.random(), np.random.rand(), torch.rand(())) == expected
    assert probe_reads(Failing(), 2000) is None
    assert probe_reads(Waiting(0), 0) is None
    loader = make_loader(Failing(), 8, device="cpu", workers="auto")  # no decision: today's plan, said why
    assert loader.plan.backend == "processes" and "could not be timed" in loader.plan.describe()


def test_the_pool_is_bounded_by_cores_and_memory() -> None:
    waiting = ReadProbe(reads=8, wall_s=0.16, cpu_s=0.004, sample_bytes=1000)
    assert size_pool(waiting, batch_size=10, cores=1, prefetch_factor=2, available_bytes=None).threads == 40
    assert size_pool(waiting, batch_size=10, cores=4, prefetch_factor=2, available_bytes=None).threads == MAX_THREADS
    small = size_pool(waiting, batch_size=10, cores=1, prefetch_factor=2, available_bytes=8 * 20_000 * 10)
    assert small.threads == small.most == 10  # 10 threads x 2 batches x 10 kB = 1/8 of 1.6 MB
    assert "memory available" in small.reasons[0]


def test_the_pool_grows_while_the_training_waits_and_batches_stay_the_same() -> None:
    kw: dict[str, Any] = {"device": "cpu", "seed": 3, "prefetch_factor": 1, "backend": "threads"}
    reference = epoch(make_loader(Waiting(200, 0.0), 2, workers=1, **kw))
    grows = make_loader(Waiting(200, 0.002), 2, workers=1, **kw)
    assert isinstance(grows, ThreadLoader)
    grows.growth = PoolGrowth(most=8, cores=1, window_s=0.02)
    assert_same(epoch(grows), reference)  # the training takes every batch at once: it waits for each
    stats = grows.fetch_stats
    assert stats.threads == grows.threads > 1
    assert_same(epoch(make_loader(Waiting(200, 0.0), 2, workers=5, **kw)), reference)


def test_the_pool_does_not_grow_past_the_cores_it_keeps_busy() -> None:
    loader = make_loader(Working(200, 0.001), 2, workers=1, device="cpu", prefetch_factor=1, backend="threads")
    assert isinstance(loader, ThreadLoader)
    loader.growth = PoolGrowth(most=8, cores=1, window_s=0.02)
    epoch(loader)
    assert loader.fetch_stats.threads == 1
    stats = PoolGrowth(most=8, cores=2)
    stats.taken(0.0, FetchStats(0, 0.0, 0.0, 2))
    assert stats.taken(0.0, FetchStats(10, 1.0, 0.01, 2)) is None  # within the window: no decision yet


def test_fetch_stats_tell_waiting_reads_from_busy_ones() -> None:
    empty = make_loader(Waiting(64), 4, workers=2, device="cpu", backend="threads")
    assert isinstance(empty, ThreadLoader)
    assert empty.fetch_stats == FetchStats(0, 0.0, 0.0, 2) and empty.fetch_stats.busy is None
    waiting = epoch(empty)
    stats = empty.fetch_stats
    assert stats.batches >= len(waiting) == 16 and stats.wall_s >= 16 * 4 * READ_S * 0.9
    assert stats.busy is not None and stats.busy < 0.5
    busy = make_loader(Working(64, 0.002), 4, workers=1, device="cpu", backend="threads")
    assert isinstance(busy, ThreadLoader)
    epoch(busy)
    stats = busy.fetch_stats
    # busy is cpu_s / wall_s; on a machine whose CPUs other work holds, the time queued for one explains the rest
    assert stats.busy is not None and (stats.busy > 0.5 or (stats.cpu_s + stats.queued_s) / stats.wall_s > 0.5)
