"""Graceful stop on SIGTERM (preemption): the loop finishes its step, saves, and exits 143.

Clusters differ in the warning they send: SLURM's `--signal=USR1@90` sends SIGUSR1 ahead of the kill so
the job can checkpoint and requeue itself; `TrainConfig(stop_signals="SIGTERM,SIGUSR1")` catches both.

`scancel` and torchrun signal the whole process group, loader workers included. A worker killed by the
signal makes the main process raise ("DataLoader worker ... is killed by signal") before it can save, so
workers ignore the stop signals (`workers_ignore`): the main process saves, then shuts them down.
Under DDP the ranks must stop at the same step: `StopSchedule` has them compare their signals about every
`AGREE_EVERY_S` seconds, at step numbers every rank computes alike, with one small all-reduce each time.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainfast.trainer.distributed import agree_on_stop

log = logging.getLogger("trainfast")
EXIT_CODE = 143  # 128 + SIGTERM, what schedulers expect from a process stopped by SIGTERM


def parse_signals(names: str) -> tuple[signal.Signals, ...]:
    """"SIGTERM,SIGUSR1" -> the signals; ValueError naming the bad name and the usual choices."""
    found = []
    for name in (n.strip().upper() for n in names.split(",") if n.strip()):
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"stop signal {name!r} is not valid; use names such as SIGTERM, SIGUSR1, SIGUSR2, "
                             "SIGINT, comma-separated (SIGKILL and SIGSTOP cannot be caught)")
        found.append(signal.Signals[name])
    if not found:
        raise ValueError(f"stop_signals={names!r} names no signal; use e.g. 'SIGTERM' or 'SIGTERM,SIGUSR1'")
    return tuple(found)


class StopSignal:
    """While active, the given signals set `requested` instead of killing the process."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.requested: signal.Signals | None = None
        self.agreed = False  # the loop decided to stop here (all ranks at the same step under DDP)
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        self.requested = signal.Signals(signum)
        log.warning("%s received: finishing the current step, then saving a checkpoint", self.requested.name)

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class IgnoreInWorker:
    """A DataLoader `worker_init_fn` that ignores `signals` in the worker, then calls the loader's own.

    A class, not a closure: loaders started with "spawn" or "forkserver" pickle it into each worker."""

    def __init__(self, signals: tuple[signal.Signals, ...], then: Callable[[int], None] | None) -> None:
        self.signals, self.then = signals, then

    def __call__(self, worker_id: int) -> None:
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def _dataloaders(loaders: Iterable[object | None]) -> Iterator[DataLoader[Any]]:
    """The torch DataLoaders behind `loaders`: a DataLoader itself, or the one a trainfast `Loader` wraps."""
    for loader in loaders:
        inner = loader if isinstance(loader, DataLoader) else getattr(loader, "dataloader", None)
        if isinstance(inner, DataLoader) and inner.num_workers > 0:
            yield inner


@contextmanager
def workers_ignore(signals: tuple[signal.Signals, ...], *loaders: object | None) -> Iterator[None]:
    """Workers the loaders start inside the block ignore `signals` (already running ones are left as they are)."""
    patched = []
    for dl in _dataloaders(loaders):
        original = dl.worker_init_fn
        if not isinstance(original, IgnoreInWorker):
            dl.worker_init_fn = IgnoreInWorker(signals, original)
            patched.append((dl, original))
    try:
        yield
    finally:
        for dl, original in patched:
            dl.worker_init_fn = original


AGREE_EVERY_S = 2.0  # how often DDP ranks compare stop signals: well inside a scheduler's grace (30 s+)


class StopSchedule:
    """The steps at which DDP ranks agree whether to stop, about every `every_s` seconds whatever `log_every` is.

    Each agreement is one all-reduce of (stop requested, steps until the next agreement): every rank proposes
    how many of its steps fill `every_s` and all take the smallest, so all ranks meet again at the same step
    without a collective (or, on CUDA, a host sync) in between.
    """

    def __init__(self, every_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.every_s = AGREE_EVERY_S if every_s is None else every_s
        self.clock = clock
        self.next_step = 0  # the first boundary step agrees (a resumed run starts beyond 0)
        self._last: tuple[int, float] | None = None  # (step, time) of the last agreement
        self.writes = 1  # the largest `writes` of any rank at the agreement of this step (reset by the next step)

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def agree(self, requested: bool, step: int, device: torch.device, writes: int = 1) -> bool:
        """Collective: call on every rank when `due(step)`. True on all ranks if any rank was signalled. `writes`
        rides along (this rank's part of a checkpoint: 0 written, 1 in flight or none, 2 failed): `writes` is then
        the largest of any rank's."""
        now = self.clock()
        interval = 1
        if self._last is not None and step > self._last[0]:
            per_step = (now - self._last[1]) / (step - self._last[0])
            interval = max(1, int(self.every_s / per_step)) if per_step > 0 else 1
        self._last = (step, now)
        stop, interval, self.writes = agree_on_stop(requested, interval, device, writes)
        self.next_step = step + interval
        return stop
