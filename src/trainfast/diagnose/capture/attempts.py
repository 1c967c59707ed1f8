"""Progress lost to torchrun's restarts (`--max-restarts`): the steps a whole run trained twice.

When a rank fails, torchrun's agent stops every rank and starts the job again (TORCHELASTIC_RESTART_COUNT counts
the attempts). A script that resumes from its last checkpoint then trains again every step between that checkpoint
and the failure, and the report of the attempt that finished would never show them. Under `doctor --whole-run`,
each rank keeps a record of its attempt on the agent's store, which outlives the attempts
(TORCHELASTIC_USE_AGENT_STORE=True): its steps, the step and time of its last checkpoint write, and how it ended.
The record is written once a second from a step boundary (a store round trip, ~100 us), at the step after each
checkpoint write, and at the end: a crash or `sys.exit` in the script, or the agent's SIGTERM to the ranks that did
not fail. The next attempt's report reads the attempts before it (`lost_progress`).

A record is exact when its attempt's end wrote it; one written on a beat (a rank killed without a signal handler
running: SIGKILL, a segfault, a signal while stuck in a collective) is up to `BEAT_S` old, and its figures are
lower bounds. Which write was the checkpoint the script resumed from is assumed: the last one its attempt made.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from types import FrameType
from typing import Any

import torch

from trainfast.diagnose.capture.ledger import Ledger
from trainfast.launch import launch_env

log = logging.getLogger("trainfast.diagnose")


BEAT_S = 1.0  # between two records written from step boundaries: at most this stale after a SIGKILL


CONNECT_S = 10.0  # the agent's store is up before any rank starts: a connection that takes longer has failed


KEY = "trainfast/doctor/attempt_{attempt}/run_{run}/progress/{rank}"


class AttemptRecord:
    """This rank's record of its attempt on the agent's store (module doc). `start()` hooks it to the ledger's
    step boundaries and to SIGTERM; `end(how)` writes the last record and unhooks."""

    def __init__(self, store: Any, ledger: Ledger, *, attempt: int, run: int, rank: int, world_size: int) -> None:
        self.store, self.ledger = store, ledger
        self.key = KEY.format(attempt=attempt, run=run, rank=rank)
        self.rank, self.world_size = rank, world_size
        self.to_unix = time.time() - time.perf_counter()  # perf_counter -> Unix time: attempts are other processes
        self._sigterm: Any = None

    def start(self) -> None:
        self.ledger.on_beat, self.ledger.beat_due = self._beat, time.perf_counter()
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a script's own handler stays its own
            self._sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def end(self, how: str) -> None:
        self.ledger.on_beat, self.ledger.beat_due = None, float("inf")
        if self._sigterm is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._write(time.perf_counter(), how)

    def _beat(self, now: float) -> None:
        self.ledger.beat_due = now + BEAT_S
        self._write(now, None)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """torchrun's agent stops the ranks that did not fail: the record is written, then the signal does what it
        would have done without the doctor."""
        self.end("stopped by SIGTERM (torchrun's agent stops every rank when one fails)")
        os.kill(os.getpid(), signal.SIGTERM)

    def _write(self, now: float, how: str | None) -> None:
        try:
            self.store.set(self.key, json.dumps(self.figures(now, how)))
        except Exception as e:  # the store is gone with the agent: the attempt goes unrecorded, the run goes on
            log.debug("doctor: attempt record not written: %s: %s", type(e).__name__, e)
            self.ledger.on_beat, self.ledger.beat_due = None, float("inf")

    def figures(self, now: float, how: str | None) -> dict[str, Any]:
        """The record at `now` (perf_counter), times in Unix time: `steps` closed, the last checkpoint write's
        (`checkpoint_steps`: steps closed before it began; `checkpoint_at`: from when the steps after it are
        trained again; None without one), `at`, `started` (the process), `ended` (how, or None on a beat)."""
        ledger = self.ledger
        steps = ledger.steps_closed()  # the script's count: the ledger keeps none before the first input seen
        write = ledger.last_write
        kept = since = None
        if write is not None:
            kept = bisect.bisect_right(ledger.step_end, write.start) + steps - len(ledger.step_end)
            # a write on the main thread stopped training until its end; in the background, the state is what it
            # was when the write began and training went on
            since = (write.start if write.background else write.end) + self.to_unix
        return {"rank": self.rank, "world_size": self.world_size, "steps": steps, "checkpoint_steps": kept,
                "checkpoint_at": since, "at": now + self.to_unix, "started": ledger.process_start + self.to_unix,
                "ended": how}


def agent_store(env: Mapping[str, str] | None = None) -> Any:
    """The client of torchrun's agent store (it outlives the attempts), when this process is a rank of a job that
    can restart (`--max-restarts` above 0) or has restarted; None otherwise or when it cannot be reached."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not torch.distributed.is_available():
        return None
    if not restarts_left(env) and attempt_of(env) == 0:
        return None
    try:
        return torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),  # type: ignore[attr-defined]
                                          is_master=False, timeout=timedelta(seconds=CONNECT_S),
                                          wait_for_workers=False)
    except Exception as e:  # KeyError, ValueError, DistStoreError: no record, no lost_progress
        log.warning("doctor: torchrun's agent store is out of reach (%s: %s): progress lost to a restart will not "
                    "be reported", type(e).__name__, e)
        return None


def restarts_left(env: Mapping[str, str] | None = None) -> bool:
    """torchrun's agent starts the job again if this attempt fails (`--max-restarts` not used up)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > attempt_of(env)
    except ValueError:
        return False


def attempt_of(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    try:
        return max(0, int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    except ValueError:
        return 0


def record_for(store: Any, ledger: Ledger, run: int, env: Mapping[str, str] | None = None) -> AttemptRecord | None:
    """This rank's `AttemptRecord` on `store` (`agent_store`), or None without one."""
    if store is None:
        return None
    launch = launch_env(env)
    return AttemptRecord(store, ledger, attempt=attempt_of(env), run=run, rank=launch.rank,
                         world_size=launch.world_size)


def lost_progress(store: Any, *, attempt: int, run: int, started: float) -> dict[str, Any] | None:
    """`lost_progress` for the report of attempt `attempt` (None for the first, or without a store): for each earlier
    attempt, the steps trained again since its last checkpoint (any rank's: under DDP the ranks step in lockstep and
    one of them writes) and their seconds, up to its end: the first end a rank recorded (the failure), else the
    latest beat (then `exact` is false: lower bounds). Without a checkpoint, the whole attempt is lost. `restart_s`:
    from that end to the next attempt's start (this process's, `started`, Unix time, for the last one)."""
    if store is None or attempt == 0:
        return None
    attempts: list[dict[str, Any]] = []
    for number in range(attempt):
        records = _records(store, number, run)
        if not records:
            attempts.append({"attempt": number, "recorded": False})
            continue
        ended = [r for r in records if r["ended"] is not None]
        end = min(ended, key=lambda r: r["at"]) if ended else max(records, key=lambda r: r["at"])
        saved = max((r for r in records if r["checkpoint_steps"] is not None), default=None,
                    key=lambda r: r["checkpoint_steps"])
        kept, since = (saved["checkpoint_steps"], saved["checkpoint_at"]) if saved else (0, end["started"])
        following = _first_start(store, number + 1, run) if number + 1 < attempt else started
        attempts.append({"attempt": number, "recorded": True, "exact": bool(ended), "ended": end["ended"],
                         "rank": end["rank"], "steps": end["steps"], "checkpoint_steps": kept if saved else None,
                         "steps_lost": max(0, end["steps"] - kept), "seconds_lost": max(0.0, end["at"] - since),
                         "restart_s": None if following is None else max(0.0, following - end["at"])})
    known = [a for a in attempts if a["recorded"]]
    return {"restarts": attempt, "steps": sum(a["steps_lost"] for a in known),
            "seconds": sum(a["seconds_lost"] for a in known),
            "restart_s": sum(a["restart_s"] or 0.0 for a in known), "attempts": attempts}


def _records(store: Any, attempt: int, run: int) -> list[dict[str, Any]]:
    """The records of attempt `attempt`: rank 0's first, which says how many ranks the attempt had."""
    first = _record(store, KEY.format(attempt=attempt, run=run, rank=0))
    world = int(first["world_size"]) if first else launch_env().world_size
    others = (_record(store, KEY.format(attempt=attempt, run=run, rank=rank)) for rank in range(1, world))
    return [r for r in (first, *others) if r is not None]


def _record(store: Any, key: str) -> dict[str, Any] | None:
    try:  # `check` first: `get` of a key no rank wrote (killed before its first beat) waits for the store's timeout
        return dict(json.loads(store.get(key))) if store.check([key]) else None
    except Exception:  # the store gone, a record cut short
        return None


def _first_start(store: Any, attempt: int, run: int) -> float | None:
    records = _records(store, attempt, run)
    return min((r["started"] for r in records), default=None)
