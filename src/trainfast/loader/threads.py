"""`ThreadLoader` (`backend="threads"`): whole batches made by a bounded pool of threads in this process, in order.

On few cores, worker processes cost the training step cycles: their IPC, and every batch pickled through
/dev/shm. JPEG decoding (Pillow) and most tensor work release the GIL, so threads decode in parallel with
neither. Each thread fetches and collates a whole batch, as a worker process would.

Determinism, the trade-off: the global RNGs (`random`, `numpy.random`, torch's default generator) are shared by
every thread, the training loop's included, so loader threads never seed or restore them. Each thread seeds its
own generators per batch from (seed, epoch, batch) instead (`seeding.batch_rngs()`): a dataset that draws from
those makes bit-identical batches with every backend. A dataset that draws from the globals directly (as
`ImageFolder`'s crops and flips from `random`) still loads, but its draws then depend on thread timing, and
advance the streams the training loop draws from: use the processes backend (or workers=0) where those
augmentations must be reproducible. Seeding the globals under a lock instead would serialise every fetch, so
the threads would not overlap at all, and still race with the training thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainfast.loader.auto import LoaderPlan
from trainfast.loader.batches import EpochBatches, EpochLoader
from trainfast.loader.faults import LoaderError, explain_failure
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
    """

    def __init__(self, dataset: Dataset[Any], batches: EpochBatches, plan: LoaderPlan, *,
                 collate_fn: Callable[[list[Any]], Any], normalize: Normalize | None, threads: int,
                 prefetch_factor: int, pin_memory: bool, timeout_s: float = 0) -> None:
        if threads < 1 or prefetch_factor < 1:
            raise ValueError(f"threads={threads} and prefetch_factor={prefetch_factor} must both be >= 1")
        self.dataset, self.batches, self.plan, self.normalize = dataset, batches, plan, normalize
        self.collate_fn, self.threads, self.prefetch_factor = collate_fn, threads, prefetch_factor
        self.pin_memory, self.timeout_s = pin_memory and torch.cuda.is_available(), timeout_s
        self.batch_size = batches.batch_size
        self._live: weakref.ref[_Epoch] | None = None

    def __iter__(self) -> Iterator[Any]:
        self.close()  # one epoch at a time: a new iter() stops the previous epoch's threads
        self._begin_epoch()
        epoch = _Epoch(self, enumerate(self.batches))
        self._live = weakref.ref(epoch)
        return epoch

    def close(self) -> None:
        """Stop this epoch's threads now (a thread busy with a batch finishes it first). Iterating again starts
        new ones."""
        live = self._live() if self._live is not None else None
        self._live = None
        if live is not None:
            live.close()

    def fetch(self, seed: int, indices: np.ndarray) -> Any:
        """One batch, as a loader thread makes it (callable from any thread; the global RNGs are not touched)."""
        with thread_seeded(seed):
            try:
                batch = self.collate_fn(self._samples(indices.tolist()))
            except Exception as e:
                _note(e, f"the batch of samples {indices.tolist()}")
                raise
        return _pin(batch) if self.pin_memory else batch

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

    def __init__(self, loader: ThreadLoader, keys: Iterator[tuple[int, tuple[int, np.ndarray]]]) -> None:
        self._loader, self._keys = loader, keys
        self._shared = shared = _Shared(loader.threads)
        self._finalizer = weakref.finalize(self, shared.stop)
        self._next = self._submitted = 0
        self._first = loader.batches._start  # batch numbers count from the resume point
        for _ in range(loader.threads * loader.prefetch_factor):
            if not self._submit():
                break
        for i in range(min(loader.threads, self._submitted)):
            worker = threading.Thread(target=_work, args=(shared, loader.fetch), daemon=True,
                                      name=f"trainfast-loader-{i}")
            shared.workers.append(worker)
            worker.start()

    def _submit(self) -> bool:
        key = next(self._keys, None)
        if key is None:
            return False
        position, (seed, indices) = key
        self._shared.tasks.put((position, seed, indices))
        self._submitted += 1
        return True

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        shared = self._shared
        if self._next >= self._submitted or shared.stopped.is_set():
            self.close()
            raise StopIteration
        ok, value = self._take(self._next)
        self._next += 1
        if not ok:
            self.close()
            _note(value, f"batch {self._batch_number(self._next - 1)} of the epoch", thread=False)
            raise self._explained(value)
        self._submit()
        return value

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

    def _batch_number(self, position: int) -> int:
        return self._first + position

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
