"""How the Trainer is fed by a loader: epoch length, position (epoch, batch), prefetching, sharding, shutdown, the
checks before its first batch and the intra-op threads beside its workers."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainfast.envcheck.checks import Check
from trainfast.envcheck.environment import preflight
from trainfast.launch import launch_env
from trainfast.loader.auto import training_threads
from trainfast.loader.prefetch import DevicePrefetcher
from trainfast.trainer.config import ConfigError

log = logging.getLogger("trainfast")


def batches_per_epoch(loader: Iterable[Any], limit: int | None) -> int:
    """Batches the Trainer takes from `loader` per epoch (its length, capped by `limit`)."""
    try:
        n = len(loader)  # type: ignore[arg-type]
    except TypeError:
        if limit is None:
            raise ConfigError("the training loader has no len(); set limit_batches so the learning-rate "
                              "schedule knows how long an epoch is") from None
        return limit
    if n == 0:
        raise ConfigError("the training loader yields no batches (empty dataset, or drop_last with fewer "
                          "samples than one batch)")
    return n if limit is None else min(n, limit)


def whole_epoch(loader: Iterable[Any], n_batches: int) -> bool:
    """Is an epoch of `n_batches` all of `loader`'s batches (its len, not cut short by limit_batches)?"""
    try:
        return len(loader) == n_batches  # type: ignore[arg-type]
    except TypeError:
        return False


def end_epoch(batches: Iterator[Any]) -> None:
    """After an epoch's last batch, ask once more, as a `for` loop would: the loader learns the epoch is over. A
    trainfast loader then hands its workers or threads, already making the next epoch's first batches, to the next
    `iter()` (without this, persistent workers are reset and the next epoch waits for its first batch: measured on
    the quick demo, 2 CPUs, 62-96 ms at each epoch's start against 6-20 ms); a DataLoader's non-persistent workers
    stop."""
    next(batches, None)


def position(loader: Iterable[Any], epoch: int, batch: int) -> Iterable[Any]:
    """Point the loader at (epoch, batch): exact and free for trainfast loaders, by reading ahead otherwise."""
    set_epoch = getattr(loader, "set_epoch", None) or getattr(getattr(loader, "sampler", None), "set_epoch", None)
    if set_epoch is not None:
        set_epoch(epoch)
    if batch == 0:
        return loader
    start_at = getattr(loader, "start_at", None)
    if start_at is not None:
        start_at(batch)
        return loader
    log.warning("resuming mid-epoch on a loader without start_at(): reading and discarding %d batches "
                "(use trainfast.make_loader for an exact, free resume)", batch)
    return itertools.islice(loader, batch, None)


def prefetch(loader: Iterable[Any], device: torch.device, channels_last: Callable[[], bool]) -> Iterable[Any]:
    """Batches on `device`, normalised, one ahead on CUDA, in the layout `channels_last()` says at each batch (an A/B
    decides it within an epoch); the loader itself when there is nothing to do."""
    normalize = getattr(loader, "normalize", None)
    if device.type == "cpu" and normalize is None and not channels_last():
        return loader  # nothing to copy or convert: no extra layer in the hot loop
    return DevicePrefetcher(loader, device, normalize=normalize, channels_last=channels_last)


def check_sharding(loader: Iterable[Any]) -> None:
    """Under DDP every rank must see its own shard; a plain DataLoader without a DistributedSampler does not."""
    if getattr(loader, "batches", None) is not None:  # trainfast loaders shard by RANK/WORLD_SIZE themselves
        return
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, torch.utils.data.DistributedSampler):
        log.warning("distributed training with a loader that is not sharded: every rank will see the whole "
                    "dataset each epoch. Use trainfast.make_loader(...) or DataLoader(..., "
                    "sampler=DistributedSampler(dataset))")


@contextmanager
def closing(*loaders: Iterable[Any] | None) -> Iterator[None]:
    """Stop the loaders' persistent workers when fit ends, however it ends (they hold memory and processes)."""
    try:
        yield
    finally:
        for loader in loaders:
            close = getattr(loader, "close", None)
            if close is not None:
                close()



def warn_before_training(loader: Iterable[Any], checkpoints: Check | None) -> None:
    """Environment checks for this loader before its first batch (shared memory, open files, CPUs, DB handles), and
    `checkpoints` (room for them, on the rank that writes them), as warnings with their fixes."""
    for check in [*preflight(loader), *([checkpoints] if checkpoints is not None else [])]:
        if check.status in ("warn", "fail"):
            fix = f" (fix: {check.fix})" if check.fix else ""
            log.warning("pre-flight %s: %s%s", check.name, check.detail, fix)


def cpu_threads_beside(loader: Iterable[Any], setting: int | str | None, device: torch.device) -> int | None:
    """Intra-op threads for training on `device` fed by `loader`: `setting` unless "auto"; for "auto" on the CPU, a
    tuning's measured best carried by the loader's plan, else the cores its workers leave (`training_threads`)."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    if device.type != "cpu":
        return None
    plan = getattr(loader, "plan", None)
    env = launch_env()  # make_loader scaled a tuning to this rank's share of the CPUs; so is the rest
    workers = plan.num_workers if plan is not None else getattr(loader, "num_workers", 0)
    chosen, reason = training_threads(plan, workers, env.cpus_per_process(), shared=env.local_world_size > 1)
    log.info("%s", reason)
    return chosen
