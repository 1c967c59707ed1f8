"""`make_loader`: a DataLoader with every speed setting resolved, and exact, cheap resume; `build_loader`, its build
step (`LoaderOptions` -> `resolve_loader` -> `build_loader`)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainfast.loader.auto import Auto, LoaderPlan
from trainfast.loader.batches import EpochBatches, EpochLoader
from trainfast.loader.faults import LoaderError, explain_failure
from trainfast.loader.latency import PoolGrowth
from trainfast.loader.memory import TensorLoader
from trainfast.loader.options import Backend, LoaderOptions, Tuned
from trainfast.loader.prefetch import Normalize
from trainfast.loader.resolve import LoaderResolution, check_batch_size, resolve_loader
from trainfast.loader.seeding import seed_all, seeded
from trainfast.loader.threads import ThreadLoader

log = logging.getLogger("trainfast")


class _SeededBatches(Dataset[Any]):
    """Fetches and collates a whole batch, its RNGs seeded from the batch's own seed (see seeding.py)."""

    def __init__(self, dataset: Dataset[Any], collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn
        self.in_worker = False

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        seed, indices = key
        indices = indices.tolist()
        if self.in_worker:  # a worker's RNGs are its own: seed them outright
            seed_all(seed)
            return self._fetch(indices)
        with seeded(seed):  # the main process: leave the training RNG stream as it was
            return self._fetch(indices)

    def _fetch(self, indices: list[int]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        return self.collate_fn(samples)


def _mark_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None  # DataLoader calls this only inside a worker
    info.dataset.in_worker = True  # type: ignore[attr-defined]


class EpochStream(torch.utils.data.Sampler[tuple[int, np.ndarray]]):
    """The DataLoader's sampler: the `batches` epoch from its start point, then the following epochs from their
    first batch, without end. So the workers go on into the next epoch's first batches while this epoch's last ones
    are used, instead of every epoch beginning with a whole batch's wait (measured on the quick demo, 25 batches
    an epoch: 64-77 ms at each epoch's first batch, ~3 % of the epoch); `Loader` takes one epoch's batches per
    `iter()`. An epoch of no batches ends the stream (it would otherwise never yield)."""

    def __init__(self, batches: EpochBatches) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        # Lazily, as EpochBatches itself: the DataLoader makes (and drops) a sampler iterator more than once when
        # it starts, and only the one it draws from may use up the start point.
        epoch = self.batches.epoch
        yield from self.batches
        while len(self.batches):
            epoch += 1
            yield from self.batches.for_epoch(epoch)


class Loader(EpochLoader):
    """Iterates batches like a DataLoader; each `iter()` is the next epoch unless `set_epoch` says otherwise.

    `start_at(b)` makes the next epoch begin at batch `b` (resume), `plan` says what was chosen and why.
    An epoch iterated to its end leaves the workers (persistent ones; none: the main process) making the next
    epoch's first batches (`EpochStream`); the next `iter()` goes on from them if it is that epoch from its start,
    else they are dropped.
    A worker that hangs past `timeout_s`, a worker killed by a signal (out of memory, /dev/shm full) or too
    many open files raise `LoaderError`, which names the causes and the fixes (the DataLoader's own error is
    its `__cause__`); the workers are stopped first, and iterating again starts new ones.
    """

    def __init__(self, dataloader: DataLoader[Any], batches: EpochBatches, plan: LoaderPlan,
                 dataset: Dataset[Any], normalize: Normalize | None) -> None:
        self.dataloader, self.batches, self.plan = dataloader, batches, plan
        self.dataset, self.normalize = dataset, normalize
        self.batch_size = batches.batch_size
        self._live: weakref.ref[Iterator[Any]] | None = None  # this epoch's DataLoader iterator, for close()
        # an ended epoch's iterator and the (epoch, start) its next batch belongs to
        self._ahead: tuple[Iterator[Any], tuple[int, int]] | None = None

    def __iter__(self) -> Iterator[Any]:
        ahead, self._ahead = self._ahead, None
        self._begin_epoch()
        count = len(self.batches) - self.batches._start
        if ahead is not None and ahead[1] == (self.batches.epoch, self.batches._start):
            it = ahead[0]  # its next batch is this epoch's first
        else:  # a new iterator (persistent workers: the same one, reset, its batches in flight dropped)
            it = iter(self.dataloader)
            if count == 0:  # nothing will be drawn from it this epoch: the start point is used up all the same
                self.batches._start = 0
        try:
            self._live = weakref.ref(it)
        except TypeError:  # an iterator without weak references (a wrapper): close() reaches persistent ones only
            self._live = None
        return _Explained(it, self, count)

    def close(self) -> None:
        """Stop the workers now instead of whenever the loader is garbage-collected (they hold memory).

        Iterating again starts new workers.
        """
        live = self._live() if self._live is not None else None
        ahead, self._live, self._ahead = self._ahead, None, None
        self._stop(live)
        if ahead is not None:
            self._stop(ahead[0])

    def _ended(self, it: Iterator[Any]) -> None:
        """`it` gave this epoch's last batch: keep it for the next epoch, whose first batches it is making; with
        `persistent_workers=False` its workers end with the epoch instead, as asked."""
        if self.plan.num_workers and not self.plan.persistent_workers:
            self._stop(it)
            return
        self._ahead = (it, (self.batches.epoch + 1, 0))

    def _stop(self, it: Iterator[Any] | None) -> None:
        """Shut down the workers of `it` (this epoch's iterator) and of the persistent iterator, if any."""
        persistent = self.dataloader._iterator
        self.dataloader._iterator = None
        for iterator in (it, persistent):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError as error:  # a worker died while stopping: nothing it owed is lost
                    if not str(error).startswith("DataLoader worker"):
                        raise
                    log.warning("make_loader: a worker died while the workers were stopped (%s); its batches "
                                "were no longer wanted, so this is only reported", error)
                    for queue in getattr(iterator, "_index_queues", ()):  # torch's shutdown stopped before this
                        queue.cancel_join_thread()
                        queue.close()
            for worker in getattr(iterator, "_workers", ()):
                if worker.is_alive():  # hung, and deaf to torch's SIGTERM: workers ignore stop signals in fit
                    worker.kill()

    def _explain(self, error: Exception) -> LoaderError | None:
        return explain_failure(error, num_workers=self.plan.num_workers, prefetch_factor=self.plan.prefetch_factor,
                               timeout_s=float(self.dataloader.timeout))


class _Explained(Iterator[Any]):
    """One epoch (`count` batches) of a DataLoader iterator whose failures become `LoaderError`s: one try/except
    around `next()`, nothing else per batch."""

    __slots__ = ("_it", "_left", "_loader")

    def __init__(self, it: Iterator[Any], loader: Loader, count: int) -> None:
        self._it, self._loader, self._left = it, loader, count

    def __iter__(self) -> _Explained:
        return self

    def __next__(self) -> Any:
        if self._left <= 0:
            if self._left == 0:  # once: the epoch's end hands the iterator on
                self._left = -1
                self._loader._ended(self._it)
            raise StopIteration
        self._left -= 1
        try:
            return next(self._it)
        except Exception as e:
            if isinstance(e, StopIteration):
                raise
            error = self._loader._explain(e)
            if error is None:
                raise
            # a hung or dead worker leaves the iterator unusable: stop its workers (a hung one is terminated
            # after torch's 5 s grace) so the next epoch starts fresh ones; never mask the error with another
            with contextlib.suppress(Exception):
                self._loader._stop(self._it)
            raise error from e


def make_loader(dataset: Dataset[Any] | Sequence[torch.Tensor], batch_size: int, *, shuffle: bool = True,
                workers: int | Auto | Tuned = "auto", pin_memory: bool | Auto = "auto",
                prefetch_factor: int | Auto = "auto", persistent_workers: bool | Auto = "auto",
                drop_last: bool | Auto = "auto", device: str | torch.device = "auto", seed: int = 0,
                collate_fn: Callable[[list[Any]], Any] | None = None, normalize: Normalize | None = None,
                rank: int | None = None, world_size: int | None = None,
                multiprocessing_context: str | None = None, timeout_s: float = 0,
                backend: Backend = "auto") -> Loader | TensorLoader | ThreadLoader:
    """A loader with every "auto" resolved for this machine; logs what it chose and why.

    `dataset` may be any map-style Dataset, or tensors already in memory (a `TensorDataset` or a
    sequence of tensors), which take the in-memory path: batched indexing, no workers, no collate; tensors
    already on the GPU are gathered there, and pinning (host memory only) does not apply to them.
    Shuffle order and per-batch augmentation seeds depend only on (seed, epoch, batch), never on the
    worker count (but a remote pack's order, whose shards are split between the worker processes: `EpochBatches`).
    `rank`/`world_size` default to torchrun's `RANK`/`WORLD_SIZE`. `workers="tuned"` takes
    workers, prefetch, pinning, the backend and (for CPU training) intra-op threads from `trainfast tune`'s result
    for this dataset and batch size, falling back to "auto" when there is none; under torchrun the tuned workers and
    threads are scaled to this process's share of the CPUs (the tuning measured one process owning them all).

    `backend="threads"`: the workers are threads of this process, each making whole batches (`ThreadLoader`: no
    IPC, for decoders that release the GIL, as Pillow's JPEG decode). Their augmentation is reproducible only when
    drawn from `trainfast.loader.seeding.batch_rngs()` (the global RNGs are shared with the training thread).
    `backend="processes"`: DataLoader worker processes, always. `backend="auto"` (the default): processes, unless
    `workers="auto"` and a few reads timed apart (~1 s at most, whatever a read does: one still running then is
    timed up to it) wait on I/O (network storage) more than they use the CPU: then threads, as many as keep the
    loader's cores busy and growing while the training waits for batches (`trainfast.loader.latency`). A dataset
    whose reads use the CPU gets the same plan either way.

    With workers: `timeout_s` > 0 bounds the wait for each batch (a hung worker then raises `LoaderError`);
    when /dev/shm is small (< 256 MiB free) or too small for workers x prefetch_factor batches (estimated for
    tensors and for datasets with `sample_bytes`), prefetch_factor is lowered to 2 or 1 with a warning, and a
    `LoaderError` is raised before any worker starts if even 1 cannot fit.

    The keywords are `LoaderOptions`' fields; this is `build_loader(resolve_loader(dataset, batch_size,
    LoaderOptions(...)))`, the two steps separately to inspect the plan before anything is built.

    >>> loader = make_loader(dataset, 64)          # doctest: +SKIP
    >>> for inputs, targets in loader: ...          # doctest: +SKIP
    """
    check_batch_size(batch_size)  # first, as before the options existed
    options = LoaderOptions(shuffle=shuffle, workers=workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                            persistent_workers=persistent_workers, drop_last=drop_last, device=device, seed=seed,
                            collate_fn=collate_fn, normalize=normalize, rank=rank, world_size=world_size,
                            multiprocessing_context=multiprocessing_context, timeout_s=timeout_s, backend=backend)
    return build_loader(resolve_loader(dataset, batch_size, options))


def build_loader(resolution: LoaderResolution) -> Loader | TensorLoader | ThreadLoader:
    """The loader `resolution` describes (a `TensorLoader` for tensors batched in place, a `ThreadLoader` for
    backend="threads" with workers, else a `Loader` over a DataLoader); logs its plan. Workers start when it is
    first iterated, not here."""
    r, options, plan = resolution, resolution.options, resolution.plan
    if r.tensors is not None:
        log.info("make_loader: in-memory path; %s", plan.describe())
        return TensorLoader(r.tensors, r.batch_size, shuffle=options.shuffle, drop_last=plan.drop_last,
                            seed=options.seed, rank=r.rank, world_size=r.world_size, pin_memory=plan.pin_memory,
                            normalize=r.normalize, plan=plan)
    # a dataset that reads whole groups of samples at once (remote shards) names them: the epoch visits a few at a
    # time, each rank and each worker process its own (threads share their process's groups: one split)
    batches = EpochBatches(r.length, r.batch_size, shuffle=options.shuffle, drop_last=plan.drop_last,
                           seed=options.seed, rank=r.rank, world_size=r.world_size,
                           groups=getattr(r.samples, "read_groups", None),
                           workers=1 if plan.backend == "threads" else max(plan.num_workers, 1))
    collate = options.collate_fn or torch.utils.data.default_collate
    if plan.backend == "threads":
        log.info("make_loader: %s", plan.describe())
        growth = None if plan.most_threads is None or plan.loader_cores is None else \
            PoolGrowth(plan.most_threads, plan.loader_cores)
        return ThreadLoader(r.samples, batches, plan, collate_fn=collate, normalize=r.normalize,
                            threads=plan.num_workers, prefetch_factor=plan.prefetch_factor or 2,
                            pin_memory=plan.pin_memory, timeout_s=options.timeout_s, growth=growth)
    fetch = _SeededBatches(r.samples, collate)
    extra: dict[str, Any] = {}
    if plan.num_workers > 0:
        extra = {"prefetch_factor": plan.prefetch_factor, "persistent_workers": plan.persistent_workers,
                 "worker_init_fn": _mark_worker, "multiprocessing_context": options.multiprocessing_context,
                 "timeout": options.timeout_s}
    dataloader = DataLoader(
        fetch, batch_size=None, sampler=EpochStream(batches), num_workers=plan.num_workers, pin_memory=plan.pin_memory,
        collate_fn=_identity,
        # Own generator: DataLoader otherwise draws its worker base seed from the global RNG at every
        # iter(), shifting the training RNG stream (dropout) by one draw per epoch or resume.
        generator=torch.Generator().manual_seed(options.seed), **extra)
    log.info("make_loader: %s", plan.describe())
    return Loader(dataloader, batches, plan, r.samples, r.normalize)


def _identity(batch: Any) -> Any:
    return batch
