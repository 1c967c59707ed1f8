"""`make_loader`: a DataLoader with every speed setting resolved, and exact, cheap resume."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal, cast

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainfast.device import device_kind
from trainfast.envcheck.environment import tensors_batch_bytes
from trainfast.host import available_cpus
from trainfast.loader import faults
from trainfast.loader.auto import Auto, LoaderPlan, plan_loader
from trainfast.loader.batches import EpochBatches, EpochLoader
from trainfast.loader.faults import LoaderError, explain_failure, fit_shared_memory
from trainfast.loader.memory import TensorLoader
from trainfast.loader.prefetch import Normalize
from trainfast.loader.seeding import seed_all, seeded
from trainfast.loader.tuned import WorkerSettings
from trainfast.loader.tuned import load as tuned_config

log = logging.getLogger("trainfast")
Tuned = Literal["tuned"]


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


class Loader(EpochLoader):
    """Iterates batches like a DataLoader; each `iter()` is the next epoch unless `set_epoch` says otherwise.

    `start_at(b)` makes the next epoch begin at batch `b` (resume), `plan` says what was chosen and why.
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

    def __iter__(self) -> Iterator[Any]:
        self._begin_epoch()
        it = iter(self.dataloader)
        try:
            self._live = weakref.ref(it)
        except TypeError:  # an iterator without weak references (a wrapper): close() reaches persistent ones only
            self._live = None
        return _Explained(it, self)

    def close(self) -> None:
        """Stop the workers now instead of whenever the loader is garbage-collected (they hold memory).

        Iterating again starts new workers.
        """
        live = self._live() if self._live is not None else None
        self._live = None
        self._stop(live)

    def _stop(self, it: Iterator[Any] | None) -> None:
        """Shut down the workers of `it` (this epoch's iterator) and of the persistent iterator, if any."""
        persistent = self.dataloader._iterator
        self.dataloader._iterator = None
        for iterator in (it, persistent):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            for worker in getattr(iterator, "_workers", ()):
                if worker.is_alive():  # hung, and deaf to torch's SIGTERM: workers ignore stop signals in fit
                    worker.kill()

    def _explain(self, error: Exception) -> LoaderError | None:
        return explain_failure(error, num_workers=self.plan.num_workers, prefetch_factor=self.plan.prefetch_factor,
                               timeout_s=float(self.dataloader.timeout))


class _Explained(Iterator[Any]):
    """A DataLoader iterator whose failures become `LoaderError`s: one try/except around `next()`, nothing else
    per batch."""

    __slots__ = ("_it", "_loader")

    def __init__(self, it: Iterator[Any], loader: Loader) -> None:
        self._it, self._loader = it, loader

    def __iter__(self) -> _Explained:
        return self

    def __next__(self) -> Any:
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


def _check_choice(name: str, value: Any, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not valid; use {valid}")


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def make_loader(dataset: Dataset[Any] | Sequence[torch.Tensor], batch_size: int, *, shuffle: bool = True,
                workers: int | Auto | Tuned = "auto", pin_memory: bool | Auto = "auto",
                prefetch_factor: int | Auto = "auto", persistent_workers: bool | Auto = "auto",
                drop_last: bool | Auto = "auto", device: str | torch.device = "auto", seed: int = 0,
                collate_fn: Callable[[list[Any]], Any] | None = None, normalize: Normalize | None = None,
                rank: int | None = None, world_size: int | None = None,
                multiprocessing_context: str | None = None, timeout_s: float = 0) -> Loader | TensorLoader:
    """A loader with every "auto" resolved for this machine; logs what it chose and why.

    `dataset` may be any map-style Dataset, or tensors already in memory (a `TensorDataset` or a
    sequence of tensors), which take the in-memory path: batched indexing, no workers, no collate; tensors
    already on the GPU are gathered there, and pinning (host memory only) does not apply to them.
    Shuffle order and per-batch augmentation seeds depend only on (seed, epoch, batch), never on the
    worker count. `rank`/`world_size` default to torchrun's `RANK`/`WORLD_SIZE`. `workers="tuned"` takes
    workers, prefetch, pinning and (for CPU training) intra-op threads from `trainfast tune`'s result for
    this dataset and batch size, falling back to "auto" when there is none.

    With workers: `timeout_s` > 0 bounds the wait for each batch (a hung worker then raises `LoaderError`);
    when /dev/shm is small (< 256 MiB free) or too small for workers x prefetch_factor batches (estimated for
    tensors and for datasets with `sample_bytes`), prefetch_factor is lowered to 2 or 1 with a warning, and a
    `LoaderError` is raised before any worker starts if even 1 cannot fit.

    >>> loader = make_loader(dataset, 64)          # doctest: +SKIP
    >>> for inputs, targets in loader: ...          # doctest: +SKIP
    """
    _check_choice("batch_size", batch_size, _is_int(batch_size, 1), "a positive integer")
    _check_choice("workers", workers, workers in ("auto", "tuned") or _is_int(workers, 0),
                  "'auto', 'tuned' or an integer >= 0")
    _check_choice("prefetch_factor", prefetch_factor, prefetch_factor == "auto" or _is_int(prefetch_factor, 1),
                  "'auto' or an integer >= 1")
    _check_choice("timeout_s", timeout_s, isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                  and math.isfinite(timeout_s) and timeout_s >= 0,
                  "a number of seconds >= 0 (0 waits for each batch forever)")
    target = _target_type(device)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    # torchrun starts one process per device; they share this machine's CPUs.
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cpus = max(1, available_cpus() // local_procs)

    tensors = _in_memory_tensors(dataset)
    if tensors is None and not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(f"make_loader needs a map-style dataset (with __getitem__ and __len__) or tensors; "
                        f"got {type(dataset).__name__}")
    n = tensors[0].shape[0] if tensors is not None else len(dataset)  # type: ignore[arg-type]
    tuned = _tuned_settings(dataset, batch_size, target) if workers == "tuned" else None
    if tuned is not None:
        workers, prefetch_factor, pin_memory = tuned.num_workers, tuned.prefetch_factor or "auto", tuned.pin_memory
    plan = plan_loader(workers="auto" if workers == "tuned" else workers, pin_memory=pin_memory,
                       prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, drop_last=drop_last,
                       shuffle=shuffle, dataset_len=n, in_memory=tensors is not None, target=target, cpus=cpus,
                       on_device=tensors is not None and all(t.device.type != "cpu" for t in tensors))
    if tuned is not None:
        plan = replace(plan, cpu_threads=tuned.cpu_threads,
                       reasons=(f"tuned by measurement ({tuned.label()})", *plan.reasons))
    norm = normalize if normalize is not None else getattr(dataset, "normalize", None)
    if tensors is not None and plan.num_workers == 0:
        log.info("make_loader: in-memory path; %s", plan.describe())
        return TensorLoader(tensors, batch_size, shuffle=shuffle, drop_last=plan.drop_last, seed=seed, rank=rank,
                            world_size=world_size, pin_memory=plan.pin_memory, normalize=norm, plan=plan)
    on_device = sorted({str(t.device) for t in tensors or () if t.device.type != "cpu"})
    if on_device:  # worker processes cannot index a GPU's memory (CUDA does not survive fork)
        raise ValueError(f"workers={plan.num_workers} with tensors on {', '.join(on_device)}: worker processes "
                         "cannot index device memory; use workers=0 (or 'auto'), which batches them in place")
    if tensors is not None and not isinstance(dataset, Dataset):
        dataset = TensorDataset(*tensors)
    samples = cast(Dataset[Any], dataset)  # any sequence of samples works, as with DataLoader
    if plan.num_workers > 0:  # before any worker starts: batches pass through /dev/shm
        plan = _fit_shared_memory(plan, tensors, samples, batch_size)
    elif timeout_s:
        plan = replace(plan, reasons=(*plan.reasons, f"timeout_s={timeout_s:g} ignored: it bounds the wait for "
                                      "worker processes and there are none"))
    batches = EpochBatches(n, batch_size, shuffle=shuffle, drop_last=plan.drop_last, seed=seed, rank=rank,
                           world_size=world_size)
    fetch = _SeededBatches(samples, collate_fn or torch.utils.data.default_collate)
    extra: dict[str, Any] = {}
    if plan.num_workers > 0:
        extra = {"prefetch_factor": plan.prefetch_factor, "persistent_workers": plan.persistent_workers,
                 "worker_init_fn": _mark_worker, "multiprocessing_context": multiprocessing_context,
                 "timeout": timeout_s}
    dataloader = DataLoader(
        fetch, batch_size=None, sampler=batches, num_workers=plan.num_workers, pin_memory=plan.pin_memory,
        collate_fn=_identity,
        # Own generator: DataLoader otherwise draws its worker base seed from the global RNG at every
        # iter(), shifting the training RNG stream (dropout) by one draw per epoch or resume.
        generator=torch.Generator().manual_seed(seed), **extra)
    log.info("make_loader: %s", plan.describe())
    return Loader(dataloader, batches, plan, samples, norm)


def _fit_shared_memory(plan: LoaderPlan, tensors: tuple[torch.Tensor, ...] | None, dataset: Any,
                       batch_size: int) -> LoaderPlan:
    """`faults.fit_shared_memory` with the free /dev/shm read now and the batch size estimated where it can be:
    tensors from their shapes, a dataset that declares `sample_bytes` (as `ImageFolder`) from that."""
    if tensors is not None:
        batch_bytes = tensors_batch_bytes(tensors, batch_size)
    else:
        try:
            per_sample = getattr(dataset, "sample_bytes", None)
        except Exception:  # a dataset's __getattr__ may do anything: the estimate is optional
            per_sample = None
        batch_bytes = batch_size * per_sample if isinstance(per_sample, int) and _is_int(per_sample, 1) else None
    plan, warning = fit_shared_memory(plan, faults.read_shm_bytes(), batch_bytes)
    if warning:
        log.warning("make_loader: %s", warning)
    return plan


def _tuned_settings(dataset: Any, batch_size: int, target: str) -> WorkerSettings | None:
    """The configuration `trainfast tune` chose for this dataset and batch size on this machine, if any."""
    chosen = tuned_config(dataset, batch_size, device=target)
    if chosen is None:
        log.info("make_loader: workers='tuned' but no tuning result for this dataset and batch size on this "
                 "machine (run `trainfast tune`); using 'auto'")
    return chosen


def _identity(batch: Any) -> Any:
    return batch


def _target_type(device: str | torch.device) -> str:
    if isinstance(device, torch.device):
        return device.type
    kind = device_kind(device)
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def _in_memory_tensors(dataset: Any) -> tuple[torch.Tensor, ...] | None:
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return tuple(dataset)
    return None
