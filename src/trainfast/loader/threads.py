"""`ThreadLoader` (`backend="threads"`): whole batches made by a bounded pool of threads in this process, in order.

On few cores, worker processes cost the training step cycles: their IPC, and every batch pickled through
/dev/shm. JPEG decoding (Pillow) and most tensor work release the GIL, so threads decode in parallel with
neither. Each thread fetches and collates a whole batch, as a worker process would.

Epoch boundaries: once an epoch's last batches are submitted, the threads go on with the next epoch's first ones
(its order and seeds depend only on (seed, epoch)), and the next `iter()` takes them over if it is that epoch from
its start. Otherwise every epoch would begin with a wait of a whole batch's loading: measured on the quick demo
(25 batches an epoch, 1 thread), 52-71 ms at each epoch's first batch against 0.2 ms at the others, ~3 % of the
epoch. `close()` (or dropping the loader) stops threads left waiting between epochs.

Determinism, the trade-off: the global RNGs (`random`, `numpy.random`, torch's default generator) are shared by
every thread, the training loop's included, so loader threads never seed or restore them. Each thread seeds its
own generators per batch from (seed, epoch, batch) instead (`seeding.batch_rngs()`): a dataset that draws from
those (as `ImageFolder` and `PackedImages` do) makes bit-identical batches with every backend. A dataset that
draws from the globals directly (`random.random()`, `np.random.rand()`) still loads, but its draws then depend on
thread timing, and
advance the streams the training loop draws from: use the processes backend (or workers=0) where those
augmentations must be reproducible. Seeding the globals under a lock instead would serialise every fetch, so
the threads would not overlap at all, and still race with the training thread.

Reads that wait (network storage): a pool given a `PoolGrowth` grows while the training waits for batches
(latency.py); every batch's wall and CPU time is counted for `fetch_stats`. Neither changes what a batch holds.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from trainfast.host import queued_s
from trainfast.loader.auto import LoaderPlan
from trainfast.loader.batches import EpochBatches, EpochLoader
from trainfast.loader.faults import LoaderError, explain_failure
from trainfast.loader.latency import FetchCounter, FetchStats, PoolGrowth
from trainfast.loader.prefetch import Normalize
from trainfast.loader.seeding import thread_seeded

log = logging.getLogger("trainfast")

# How long close() waits for a thread busy with a batch before leaving it (a daemon: it cannot block exit).
JOIN_TIMEOUT_S = 10.0
_PATHS_NAMED = 4


class ThreadLoader(EpochLoader):
    """Iterates batches like `Loader`, made by `threads` threads with at most `threads * prefetch_factor` batches
    in flight, yielded strictly in order; each `iter()` is the next epoch unless `set_epoch` says otherwise.

    A batch is fetched as with the other backends (the dataset's `__getitems__` or `__getitem__` per index, then
    `collate_fn`), with this thread's `batch_rngs()` seeded from the batch's seed. A failure is raised at that
    batch's position: the dataset's own exception, with a note naming the batch, the sample and its path (when
    the dataset has `path(index)`), or a `LoaderError` for too many open files. `timeout_s` > 0 bounds the wait
    for each batch (`LoaderError`, kind "timeout"). The threads start at `iter()`; `close()`, garbage collection
    of the epoch's iterator (a `break`) and the end of the epoch stop them.

    `growth`: when and how far the pool grows while the training waits for batches (reads that wait on storage);
    None keeps `threads`. `fetch_stats` says what the threads measured.
    """

    def __init__(self, dataset: Dataset[Any], batches: EpochBatches, plan: LoaderPlan, *,
                 collate_fn: Callable[[list[Any]], Any], normalize: Normalize | None, threads: int,
                 prefetch_factor: int, pin_memory: bool, timeout_s: float = 0,
                 growth: PoolGrowth | None = None) -> None:
        if threads < 1 or prefetch_factor < 1:
            raise ValueError(f"threads={threads} and prefetch_factor={prefetch_factor} must both be >= 1")
        self.dataset, self.batches, self.plan, self.normalize = dataset, batches, plan, normalize
        self.collate_fn, self.threads, self.prefetch_factor = collate_fn, threads, prefetch_factor
        self.pin_memory, self.timeout_s = pin_memory and torch.cuda.is_available(), timeout_s
        self.batch_size, self.growth = batches.batch_size, growth
        self._counter = FetchCounter()
        self._live: weakref.ref[_Epoch] | None = None
        self._ahead: _Ahead | None = None  # the last epoch's threads, already making the next epoch's first batches

    @property
    def fetch_stats(self) -> FetchStats:
        """Batches fetched since the loader was built, the wall and thread CPU seconds inside those fetches, and
        the pool's size now (and the seconds the threads waited for a CPU)."""
        return self._counter.stats(self.threads)

    def __iter__(self) -> Iterator[Any]:
        ahead, self._ahead = self._ahead, None
        self.close()  # one epoch at a time: a new iter() stops the previous epoch's threads
        self._begin_epoch()
        if ahead is not None and ahead.epoch == self.batches.epoch and self.batches._start == 0:
            epoch = _Epoch(self, ahead.keys, ahead)
        else:  # another epoch (set_epoch) or a resume point: what was made ahead is not this epoch's
            if ahead is not None:
                ahead.stop()
            epoch = _Epoch(self, iter(self.batches))
        self._live = weakref.ref(epoch)
        return epoch

    def close(self) -> None:
        """Stop this epoch's threads now (a thread busy with a batch finishes it first), and those making the next
        epoch's first batches. Iterating again starts new ones."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stop()
        live = self._live() if self._live is not None else None
        self._live = None
        if live is not None:
            live.close()

    def _following(self) -> tuple[int, Iterator[tuple[int, np.ndarray]]]:
        """The epoch after the one being iterated (as the next `iter()` will begin it unless told otherwise), and
        its (seed, indices) from its first batch; the loader's own `batches` are left as they are."""
        return self._next_epoch, iter(self.batches.for_epoch(self._next_epoch))

    def fetch(self, seed: int, indices: np.ndarray) -> Any:
        """One batch, as a loader thread makes it (callable from any thread; the global RNGs are not touched)."""
        queued0, cpu0, wall0 = queued_s(), time.thread_time(), time.perf_counter()
        try:
            with thread_seeded(seed):
                try:
                    batch = self.collate_fn(self._samples(indices.tolist()))
                except Exception as e:
                    _note(e, f"the batch of samples {indices.tolist()}")
                    raise
            return _pin(batch) if self.pin_memory else batch
        finally:
            self._counter.add(time.perf_counter() - wall0, time.thread_time() - cpu0, queued_s() - queued0)

    def _samples(self, indices: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices))
        samples = []
        for i in indices:
            try:
                samples.append(self.dataset[i])
            except Exception as e:
                _note(e, f"sample {i}{_path(self.dataset, i)}")
                raise
        return samples


class _Shared:
    """What the threads and the consumer share; the threads hold this, never the `_Epoch`, so dropping the
    iterator (a `break`) lets it be collected, and its finalizer stops them."""

    def __init__(self, threads: int) -> None:
        self.tasks: queue.SimpleQueue[tuple[int, int, np.ndarray] | None] = queue.SimpleQueue()
        self.results: dict[int, tuple[bool, Any]] = {}
        self.ready = threading.Condition()
        self.stopped = threading.Event()
        self.workers: list[threading.Thread] = []
        self.count = threads

    def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        for _ in self.workers:
            self.tasks.put(None)
        me = threading.current_thread()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for worker in self.workers:
            if worker is not me:
                worker.join(max(0.0, deadline - time.monotonic()))
        with self.ready:
            self.results.clear()  # batches made but never taken


class _Ahead(NamedTuple):
    """An ended epoch's threads and results, handed to the next `iter()`: `epoch`'s remaining (seed, indices),
    `base` the position of its first batch, `submitted` the positions submitted so far (past the ended epoch's)."""

    shared: _Shared
    finalizer: weakref.finalize[Any, Any]  # stops the threads if the loader goes before the next iter()
    epoch: int
    keys: Iterator[tuple[int, np.ndarray]]
    base: int
    submitted: int

    def stop(self) -> None:
        self.finalizer()


def _weak_fetch(loader: ThreadLoader) -> Callable[[int, np.ndarray], Any]:
    """`loader.fetch` without a strong reference: threads waiting between epochs must not keep the loader alive (its
    collection is what stops them when it is never closed)."""
    ref = weakref.ref(loader)

    def fetch(seed: int, indices: np.ndarray) -> Any:
        owner = ref()
        if owner is None:
            raise LoaderError("the loader was closed", "worker_exited")
        return owner.fetch(seed, indices)
    return fetch


def _work(shared: _Shared, fetch: Callable[[int, np.ndarray], Any]) -> None:
    while True:
        task = shared.tasks.get()
        if task is None or shared.stopped.is_set():
            return
        position, seed, indices = task
        try:
            result: tuple[bool, Any] = (True, fetch(seed, indices))
        except Exception as e:
            result = (False, e)
        with shared.ready:
            if not shared.stopped.is_set():
                shared.results[position] = result
            shared.ready.notify_all()


class _Epoch(Iterator[Any]):
    """One epoch of a `ThreadLoader`: keeps `threads * prefetch_factor` batches in flight, yields them in order."""

    def __init__(self, loader: ThreadLoader, keys: Iterator[tuple[int, np.ndarray]], ahead: _Ahead | None = None
                 ) -> None:
        self._loader, self._keys = loader, keys
        self._end: int | None = None  # position past this epoch's last batch, once all of them are submitted
        self._following: tuple[int, Iterator[tuple[int, np.ndarray]]] | None = None
        self._first = loader.batches._start  # batch numbers count from the resume point
        if ahead is not None:  # the previous epoch's threads, with this epoch's first batches in flight
            self._shared, self._base, self._submitted = ahead.shared, ahead.base, ahead.submitted
            ahead.finalizer.detach()
            self._finalizer = weakref.finalize(self, ahead.shared.stop)
            self._next = self._base
            return
        self._shared = shared = _Shared(loader.threads)
        self._finalizer = weakref.finalize(self, shared.stop)
        self._next = self._submitted = self._base = 0
        if loader.growth is not None:  # this epoch's first batch waits for the pipeline to fill, whatever its size
            loader.growth.restart()
        self._add_threads(loader.threads)

    def _add_threads(self, count: int) -> None:
        """Start `count` more threads and put `prefetch_factor` more batches in flight for each."""
        loader, shared = self._loader, self._shared
        for _ in range(count * loader.prefetch_factor):
            if not self._submit():
                break
        fetch = _weak_fetch(loader)
        for _ in range(count):
            name = f"trainfast-loader-{len(shared.workers)}"
            worker = threading.Thread(target=_work, args=(shared, fetch), daemon=True, name=name)
            shared.workers.append(worker)
            worker.start()
        shared.count = len(shared.workers)

    def _submit(self) -> bool:
        """Put the next batch in flight: this epoch's, then the following epoch's first ones."""
        key = next(self._keys, None) if self._end is None else None
        if key is None:
            if self._end is None:
                self._end, self._following = self._submitted, self._loader._following()
            key = next(self._following[1], None) if self._following is not None else None
            if key is None:
                return False
        seed, indices = key
        self._shared.tasks.put((self._submitted, seed, indices))
        self._submitted += 1
        return True

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        shared = self._shared
        if shared.stopped.is_set():
            self.close()
            raise StopIteration
        if self._end is not None and self._next >= self._end:
            self._hand_over()
            raise StopIteration
        started = time.perf_counter()
        ok, value = self._take(self._next)
        self._next += 1
        if not ok:
            self.close()
            _note(value, f"batch {self._batch_number(self._next - 1)} of the epoch", thread=False)
            raise self._explained(value)
        self._submit()
        if self._loader.growth is not None:
            self._grow(time.perf_counter() - started)
        return value

    def _grow(self, waited_s: float) -> None:
        """Grow the pool when `PoolGrowth` says the training waits for batches and the CPU has room."""
        loader = self._loader
        assert loader.growth is not None
        grown = loader.growth.taken(waited_s, loader.fetch_stats)
        if grown is None or self._shared.stopped.is_set():
            return
        log.info("make_loader: %d -> %d loader threads: the training waited for batches (%d batches in flight at "
                 "most now)", loader.threads, grown, grown * loader.prefetch_factor)
        added, loader.threads = grown - loader.threads, grown
        self._add_threads(added)

    def _take(self, position: int) -> tuple[bool, Any]:
        shared, timeout = self._shared, self._loader.timeout_s
        deadline = time.monotonic() + timeout if timeout > 0 else None
        with shared.ready:
            while position not in shared.results:
                if not any(w.is_alive() for w in shared.workers):
                    raise LoaderError("the loader threads stopped before batch "
                                      f"{self._batch_number(position)} was made", "worker_exited")
                wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if wait <= 0:
                    break
                shared.ready.wait(wait)
            else:
                return shared.results.pop(position)
        self.close()
        raise LoaderError(
            f"the loader threads did not make batch {self._batch_number(position)} within timeout_s={timeout:g} s: "
            "the dataset's __getitem__ is stuck or far slower than that (a lock, a stalled network file system, a "
            "decoder); raise timeout_s if batches are legitimately this slow, or try workers=0 to see where it "
            "blocks.", "timeout")

    def _hand_over(self) -> None:
        """The epoch is over: give its threads, with the following epoch's first batches, to the loader's next
        `iter()`; stopped instead when this is no longer the loader's epoch or nothing was made ahead."""
        loader, following = self._loader, self._following
        live = loader._live() if loader._live is not None else None
        if following is None or self._submitted == self._end or live is not self:
            self.close()
            return
        self._finalizer.detach()
        shared = self._shared
        loader._ahead = _Ahead(shared, weakref.finalize(loader, shared.stop), following[0], following[1],
                               self._end or 0, self._submitted)
        loader._live = None

    def _batch_number(self, position: int) -> int:
        return self._first + position - self._base

    def _explained(self, error: Exception) -> Exception:
        explained = explain_failure(error, num_workers=0, prefetch_factor=None, timeout_s=self._loader.timeout_s)
        if explained is not None:
            explained.__cause__ = error
            return explained
        return error

    def close(self) -> None:
        self._finalizer()


def _note(error: BaseException, where: str, thread: bool = True) -> None:
    """Name the failing batch or sample on the error (Python >= 3.11), without changing its type."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        who = f"trainfast loader thread {threading.current_thread().name}" if thread else "trainfast loader"
        add_note(f"{who}: while fetching {where}")


def _path(dataset: Any, index: int) -> str:
    path = getattr(dataset, "path", None)
    if not callable(path):
        return ""
    with contextlib.suppress(Exception):
        return f" ({path(index)})"
    return ""


def _pin(batch: Any) -> Any:
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(batch)
