"""Graceful stop on SIGTERM (preemption): the loop finishes its step, saves, and exits 143.

Clusters differ in the warning they send: SLURM's `--signal=USR1@90` sends SIGUSR1 ahead of the kill so
the job can checkpoint and requeue itself; `TrainConfig(stop_signals="SIGTERM,SIGUSR1")` catches both.
"""

from __future__ import annotations

import logging
import signal
import threading
import types
from typing import Any

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
