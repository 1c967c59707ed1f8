"""The loaders' hook: every DataLoader (and trainfast's `TensorLoader` and `ThreadLoader`) the script iterates is
described (its settings: `describe_loader`) and its iterator wrapped to time each `next()` (data wait), the worker
start-up of each epoch (`iter()` to first batch) and the batch bytes; worker processes forked while it is installed
time their own batches into the `WorkerClock` (worker_clock.py); what the loop sets on a DataLoader's dataset after
it started is noted (dataset_watch.py). One `perf_counter` pair per batch; a batch made in
the main thread (no workers) after a slow one is also timed for its CPU and run-queue time (`TIMED_WAIT_S`)."""

from __future__ import annotations

import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass, replace
from time import perf_counter, thread_time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset
from torch.utils.data._utils import worker as worker_module
from torch.utils.data._utils.fetch import _IterableDatasetFetcher, _MapDatasetFetcher

from trainfast.diagnose.capture.dataset_watch import DatasetWatch, Fetches
from trainfast.diagnose.capture.sites import site_of
from trainfast.diagnose.capture.worker_clock import WorkerClock
from trainfast.diagnose.records.capture import Site
from trainfast.diagnose.records.steps import LoaderStats
from trainfast.host import queued_s
from trainfast.loader.memory import TensorLoader
from trainfast.loader.threads import ThreadLoader
from trainfast.samples import batch_samples, first_leaf

if TYPE_CHECKING:
    from trainfast.diagnose.capture.observations import Patch, Watching

# Batches made in the main thread are timed for their CPU and run-queue time too (workers.py) when the one before
# took this long: ~13 us a timed batch between steps here (two thread_time and schedstat reads), 1.3 % of a 1 ms
# fetch, but as much as all the other hooks of a tiny step from data already in memory, which needs no such figure
TIMED_WAIT_S = 1e-3


class LoaderHook:
    """The loaders seen (`loaders`, in the order their first iterator was made) and the workers' clock."""

    def __init__(self, inst: Watching, on_loader: Callable[[Any], None] | None = None) -> None:
        self.inst = inst
        self.on_loader = on_loader  # called before each iter() of a loader: the pre-flight checks
        self.loaders: list[LoaderStats] = []
        self.worker_clock = WorkerClock()  # loader workers forked while measuring time their batches into it
        self._by_loader: dict[int, LoaderStats] = {}
        self._keep_alive: list[Any] = []  # loaders described: their id() must stay unique while measuring
        self._made: weakref.WeakKeyDictionary[Any, Site] = weakref.WeakKeyDictionary()  # where each was constructed
        self.sites: list[Site] = []  # the described loaders' (Site.index: their LoaderStats.index)
        self.dataset_watch = DatasetWatch()  # what the loop sets on a dataset after its loader started

    def install(self, patch: Patch) -> None:
        inst = self.inst

        def wrap_iter(original: Callable[[Any], Iterator[Any]]) -> Callable[[Any], Iterator[Any]]:
            def timed_iter(loader: Any) -> Iterator[Any]:
                if self.on_loader is not None:
                    self.on_loader(loader)
                started = time.perf_counter()
                it = original(loader)
                stats = self.stats_for(loader)
                if stats.epochs == 0:
                    self._keep_alive.append(loader)
                stats.epochs += 1
                fetches = self.dataset_watch.started(stats, _user_dataset(loader), in_process=not loader.num_workers) \
                    if isinstance(loader, DataLoader) else None  # (threads share the script's dataset: no copy)
                return _TimedIterator(it, stats, inst, started, loader if isinstance(loader, ThreadLoader) else None,
                                      fetches)
            return timed_iter

        for owner in (DataLoader, TensorLoader, ThreadLoader):
            patch(owner, "__iter__", wrap_iter(owner.__iter__))
        construct = DataLoader.__init__

        @functools.wraps(construct)
        def made(loader: Any, *args: Any, **kwargs: Any) -> None:
            site = site_of("loader", sys._getframe(1))
            if site is not None:
                self._made[loader] = site
            construct(loader, *args, **kwargs)
        patch(DataLoader, "__init__", made)
        # workers forked from here on time their batches (the main process's fetches are left as they are)
        patch(worker_module, "_worker_loop", _TimingWorkerLoop(self.worker_clock, worker_module._worker_loop))

    def uninstall(self) -> None:
        self.dataset_watch.check()  # what the loop set on the datasets since their last iter()
        self.dataset_watch.clear()
        self._keep_alive.clear()  # torch may keep our hooks (and so this) alive: never the script's loaders

    def stats_for(self, loader: Any) -> LoaderStats:
        stats = self._by_loader.get(id(loader))
        if stats is None:
            stats = describe_loader(loader, len(self.loaders))
            self._by_loader[id(loader)] = stats
            self.loaders.append(stats)
            site = self._made.get(loader)
            if site is not None:
                self.sites.append(replace(site, index=stats.index))
        return stats


class _TimingWorkerLoop:
    """DataLoader's worker entry point, which first makes the worker's fetches time themselves into the clock (in the
    worker process only: nothing there is restored, the process ends with the loop). Pickled for a worker started by
    spawn or forkserver, it is torch's own entry point: the clock's shared memory does not reach such a process."""

    def __init__(self, clock: WorkerClock, original: Callable[..., None]) -> None:
        self.clock, self.original = clock, original

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        for fetcher in (_MapDatasetFetcher, _IterableDatasetFetcher):
            fetcher.fetch = _timed(self.clock, fetcher.fetch)  # type: ignore[method-assign]
        self.original(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _torch_worker_loop, ()


def _torch_worker_loop() -> Callable[..., None]:
    """torch's worker entry point, as a process started afresh has it (unpatched)."""
    return worker_module._worker_loop


def _timed(clock: WorkerClock, fetch: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def timed_fetch(fetcher: Any, index: Any) -> Any:
        with clock.timed():
            return fetch(fetcher, index)
    return timed_fetch


class _TimedIterator:
    """Wraps a loader's iterator: times each `next()`; everything else passes through."""

    def __init__(self, it: Iterator[Any], stats: LoaderStats, inst: Watching, started: float,
                 threads: Any = None, fetches: Fetches | None = None) -> None:
        self._it, self._stats, self._inst, self._started = it, stats, inst, started
        self._threads = threads  # a ThreadLoader: its threads time their batches themselves
        self._fetches = fetches  # the first batches' fetches, watched for what the dataset sets itself
        self._first = True
        self._slow = False  # the last batch took TIMED_WAIT_S or more (an epoch's first is not timed: its start-up)

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        inst = self._inst
        if inst.scanning:
            inst.discover("batch")
        stats = self._stats
        fetches = self._fetches  # (its notes outside the timed wait: the doctor's time, not the loader's)
        noted = fetches.before() if fetches is not None else None
        timed = self._slow and not stats.num_workers  # (TIMED_WAIT_S)
        queued = queued_s() if timed else 0.0
        asked, cpu = perf_counter(), thread_time() if timed else 0.0
        inst.fetching = True  # forwards inside the dataset (a transform module) are not the model's
        try:
            batch = next(self._it)
        finally:
            inst.fetching = False
        got = perf_counter()
        if fetches is not None and noted is not None and not fetches.after(noted):
            self._fetches = None
        self._slow = got - asked >= TIMED_WAIT_S
        threads = self._threads
        if threads is not None:  # a thread-backed loader's own account of its threads' batches
            made = threads.fetch_stats
            stats.fetch_cpu_s, stats.fetch_wall_s, stats.fetch_queued_s = made.cpu_s, made.wall_s, made.queued_s
            stats.fetch_batches, stats.num_workers = made.batches, made.threads  # (its pool may have grown)
        elif timed:  # its CPU time tells reading from working (workers.py)
            stats.fetch_cpu_s += thread_time() - cpu
            stats.fetch_wall_s += got - asked
            stats.fetch_queued_s += queued_s() - queued
            stats.fetch_batches += 1
        ledger = inst.ledger
        first = self._first
        # an evaluation pass: validation runs under no_grad / inference_mode, or a loader that never fed training
        # fetches while the model seen training is in eval mode (the HF Trainer's evaluation loop fetches outside
        # its no_grad; its training loop fetches the next batch before model.train())
        evaluation = not torch.is_grad_enabled() or (stats.batches == stats.evaluation_batches and inst.evaluating())
        if first:
            self._first = False
            stats.startup_s.append(got - self._started)
            if stats.batch_bytes is None:
                stats.batch_bytes, stats.image_hw = batch_info(batch)
            if ledger is not None and not evaluation:
                ledger.epoch_started(self._started, asked, got)
        stats.batches += 1
        stats.wait_s += got - asked
        if evaluation:
            stats.evaluation_batches += 1
            inst.timeline.evaluation_fetch()
            if ledger is not None:  # (an evaluation epoch's start-up is the pass's)
                ledger.eval_fetch(self._started if first else asked, asked, got)
            return batch
        samples = batch_samples(batch, stats.batch_size or 0)
        if stats.batch_size and samples > stats.batch_size:  # not a batch dimension (a first tensor of points)
            samples = stats.batch_size
        inst.timeline.fetched(asked, got, samples)
        if first:
            inst.timeline.epoch_began()
        if not inst.device_timer.settled:
            inst.saw_batch(batch)
        if inst.events is not None and inst.timeline.in_measured_step:
            inst.events.batch_ready()
        return batch

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


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
    dataset = _user_dataset(loader)
    kind, batch_size = "DataLoader", loader.batch_size
    if dataset is not loader.dataset:
        kind, batch_size = "trainfast Loader", getattr(loader.sampler, "batch_size", None)
    workers = loader.num_workers
    context = loader.multiprocessing_context
    return LoaderStats(
        index=index, kind=kind + (f" ({context.get_start_method()})" if workers and context else ""),
        dataset=_dataset_name(dataset), num_workers=workers, pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor if workers else None,
        batch_size=batch_size, in_memory=_tensors_in_memory(dataset), decode=getattr(dataset, "decode", None),
        batches_per_epoch=per_epoch)


def _user_dataset(loader: DataLoader[Any]) -> Any:
    """The script's dataset: a DataLoader's, or inside make_loader's wrapper (a trainfast Loader's)."""
    dataset, inner = loader.dataset, getattr(loader.dataset, "dataset", None)
    return inner if type(dataset).__name__ == "_SeededBatches" and inner is not None else dataset


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
