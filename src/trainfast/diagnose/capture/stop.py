"""Under torchrun (2+ ranks, each running the doctor) no rank stops on its own clock: one that stopped alone would
leave its peers in an all-reduce it never joins (a hang until the collective's timeout, or a crash when its
connection drops). A rank that wants to stop (steps measured, deadline passed, SIGALRM) proposes a step a little
ahead on torchrun's store under its own key prefix; every rank reads the store every `STOP_CHECK_EVERY` steps
and all stop at the step first proposed (timeline.py says why that step is reached by all). Why the store: it
needs nothing from the script's process group (a collective of ours on it could interleave with DDP's own and
deadlock), costs one round trip every few steps instead of a collective per step, and torchrun's agent hosts it
for the job's whole life. A rank that is still running a while after its SIGALRM is stuck, and stops alone
(script.py's `alarm`)."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from trainfast.launch import launch_env

log = logging.getLogger("trainfast.diagnose")


# Under torchrun: closed steps between two reads of the agreed stop step. A read is a round trip to the store in
# torchrun's agent process (50-100 us on this loaded 2-core machine): +9-14 us a step measured on a 50 us null step,
# where reading every step cost +46-100 us; ~1 % of a 1 ms DDP step on gloo. Every rank stops at most
# STOP_CHECK_EVERY + 3 steps after the one that asked.
STOP_CHECK_EVERY = 8


# Reaching torchrun's store: the agent's is up before the script starts; without one (TORCHELASTIC_USE_AGENT_STORE
# unset), rank 0's process group hosts it, which the script starts before its first step.
STORE_CONNECT_S = 30.0


STOP_KEY = "stop"


_RUNS = itertools.count()  # doctor runs in this process: each gets its own keys on the store (every rank counts alike)


class StoreStop:
    """A `StopAgreement` (timeline.py) on a store every rank reaches: the first rank to propose sets the stop
    (`compare_set` on an absent key: one atomic round trip), every rank reads that one. A store that fails is given
    up, logged once: the rank then stops alone, as a single process does."""

    check_every = STOP_CHECK_EVERY

    def __init__(self, connect: Callable[[], Any], rank: int) -> None:
        self._connect, self.rank = connect, rank
        self._store: Any = None
        self._failed = False
        self.asked_by: int | None = None  # the rank whose proposal every rank follows

    def connect(self) -> bool:
        return self._call(lambda store: b"ok") is not None

    def propose(self, step: int, reason: str) -> tuple[int, str] | None:
        return self._parse(self._call(lambda store: store.compare_set(STOP_KEY, "", f"{step} {self.rank} {reason}")))

    def agreed(self) -> tuple[int, str] | None:
        return self._parse(self._call(lambda store: store.get(STOP_KEY) if store.check([STOP_KEY]) else None))

    def store(self) -> Any:
        """The job's store under this run's prefix (connected, or connecting now: may raise), for what the ranks
        send each other after the run (ranks.py); None when it already failed during the run."""
        if self._failed:
            return None
        if self._store is None:
            self._store = self._connect()
        return self._store

    def _call(self, operation: Callable[[Any], bytes | None]) -> bytes | None:
        if self._failed:
            return None
        try:
            if self._store is None:
                self._store = self._connect()
            return operation(self._store)
        except Exception as e:  # DistStoreError, DistNetworkError, a timeout: the job's store is out of reach
            self._failed = True
            log.warning("doctor: rank %d cannot use torchrun's store (%s: %s): it stops on its own clock and step "
                        "count, and a rank still inside a collective then may hang until its timeout",
                        self.rank, type(e).__name__, e)
            return None

    def _parse(self, value: bytes | None) -> tuple[int, str] | None:
        if not value:
            return None
        step, rank, reason = value.decode().split(" ", 2)
        self.asked_by = int(rank)
        return int(step), reason


def launched_ranks(env: Mapping[str, str] | None = None) -> int:
    """The job's world size when this process is a rank launched by torchrun (TORCHELASTIC_RUN_ID) or another
    launcher giving 2+ ranks their RANK / WORLD_SIZE; 0 for a process on its own (RANK=0 WORLD_SIZE=1 set by
    hand, for a script that initialises a process group from the environment, is one)."""
    env = os.environ if env is None else env
    try:
        world = launch_env(env).world_size
    except ValueError:  # malformed: the script's own launch fails with its own message, not the doctor's
        world = 1
    return world if "TORCHELASTIC_RUN_ID" in env or world > 1 else 0


def rank_agreement(env: Mapping[str, str] | None = None, *, run: int | None = None) -> StoreStop | None:
    """The stop agreement of a job with 2+ ranks, on its store (MASTER_ADDR:MASTER_PORT, torchrun's agent store
    when TORCHELASTIC_USE_AGENT_STORE=True), under a key prefix of ours per attempt and doctor run; None for a
    single process or without a store address."""
    env = os.environ if env is None else env
    if launched_ranks(env) < 2 or not torch.distributed.is_available():
        return None
    try:
        host, port, rank = env["MASTER_ADDR"], int(env["MASTER_PORT"]), launch_env(env).rank
    except (KeyError, ValueError) as e:
        log.warning("doctor: %d ranks but no store to agree on a stop step through (%s: %s): each rank stops on "
                    "its own clock", launched_ranks(env), type(e).__name__, e)
        return None
    # a restarted attempt must not read the stop of the attempt before it
    run = next(_RUNS) if run is None else run
    prefix = f"trainfast/doctor/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/run_{run}/"

    def connect() -> Any:
        client = torch.distributed.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                                            timeout=timedelta(seconds=STORE_CONNECT_S), wait_for_workers=False)
        return torch.distributed.PrefixStore(prefix, client)  # type: ignore[attr-defined]
    agreement = StoreStop(connect, rank)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agreement.connect()  # up already: a failure shows now, not mid-run
    return agreement
