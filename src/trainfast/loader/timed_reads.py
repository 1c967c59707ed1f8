"""A few of a dataset's reads, timed apart from the training and cut off at a deadline (`time_reads`).

Storage at scale stalls now and then (an NFS server's hiccup, an object store's tail latency: seconds, or forever),
and `make_loader` must not wait for it. A read cannot be stopped from outside in Python, so the reads run where one
left running can do no harm: in a forked child (Linux, named `trainfast-probe`, dying with its parent), which sends
each read's figures down a pipe as it finishes, is killed at the deadline and reaped, and whose late draws from the
global RNGs, open handles and exceptions die with it. Forking is what torch's DataLoader does to start its workers,
CUDA initialised or not; torch's guidance is that a forked child cannot use CUDA (it raises "Cannot re-initialize
CUDA in forked subprocess"), not that the fork harms the parent. So a read that needs CUDA fails in the child, and
the reads are then timed in a thread, as they are where there is no fork (macOS, whose system libraries are unsafe
after a fork, and Windows). In a thread a read left running goes on after the deadline: its result and any exception
are dropped, but its draws from the global RNGs, if it makes any, shift the training's stream, and its open handles
stay open. The child's and the thread's CPU time is their own process's: the child's is its reads' alone, one
intra-op thread as in a DataLoader worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainfast.host import queued_s
from trainfast.loader.seeding import seeded

# torch's message when a forked child touches CUDA that its parent had initialised (torch/cuda/__init__.py)
CUDA_IN_FORK = "Cannot re-initialize CUDA in forked subprocess"
# How long a killed child may take to be reaped here before a background thread waits for it (a read blocked in
# the kernel, as on a hard NFS mount, dies when the kernel lets it).
REAP_S = 0.2

# What the reads report as they go: ("start", sample, perf_counter, process_time, queued_s) before each read, then
# ("warm",) or ("done", wall_s, cpu_s, queued_s, sample_bytes), and last ("end",), ("failed",) or ("cuda",).
Message = tuple[Any, ...]
# prctl's options (linux/prctl.h): signal a child when its parent dies; set a thread's name (15 bytes at most)
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
# The child's name (`ps -o comm`, psutil's name()): a process monitor can tell it from a loader worker
CHILD_NAME = b"trainfast-probe"


@dataclass(frozen=True)
class CutOff:
    """The read still running at the deadline: its sample, and its wall, CPU and CPU-queue seconds until then
    (`cpu_known` False where its CPU time could not be read: it is then counted as 0)."""

    index: int
    wall_s: float
    cpu_s: float
    queued_s: float
    cpu_known: bool = True


@dataclass(frozen=True)
class TimedReads:
    """The timed reads that finished (`reads`, their summed `wall_s`, `cpu_s`, `queued_s`, the last sample's bytes
    as `measure` told) and the read cut off at the deadline, if one was (`cut_off`)."""

    reads: int
    wall_s: float
    cpu_s: float
    queued_s: float
    sample_bytes: int | None
    cut_off: CutOff | None


def can_fork() -> bool:
    """Whether the reads run in a forked child here: Linux only (macOS's system frameworks are unsafe in a forked
    child, which is why Python's default start method there is spawn; Windows has no fork). The child costs
    make_loader ~40 ms more than a thread (median, a 235 MB process forking on 2 cores busy with other work)."""
    return sys.platform == "linux" and hasattr(os, "fork")


def time_reads(dataset: Any, warmup: int | None, timed: Sequence[int], *, budget_s: float, deadline_s: float,
               measure: Callable[[Any], int | None], fork: bool | None = None) -> TimedReads | None:
    """Read `dataset[warmup]` untimed (None: no warm-up), then `dataset[i]` for each of `timed` until their summed
    wall time reaches `budget_s`; return within about `deadline_s` whatever a read does. The reads see the global
    RNGs seeded with 0 (`seeded`). `fork` None: in a forked child where `can_fork()`, else in a thread.

    Each read's wall, CPU and CPU-queue seconds are measured where it runs: the CPU time is that process's (a
    child's is its reads' alone; in a thread, the whole process's, the caller waiting meanwhile). None when a
    read failed or none began before the deadline: no decision.
    """
    start = time.perf_counter()
    run = _in_child(dataset, warmup, timed, budget_s, start + deadline_s, measure) \
        if (can_fork() if fork is None else fork) else None
    # in a thread where there is no fork, where it failed, or where the read needs CUDA, which a forked child cannot use
    if run is None or (run[0] and run[0][-1][0] == "cuda"):
        run = _in_thread(dataset, warmup, timed, budget_s, start + deadline_s, measure)
    return _summary(*run)


def _read(dataset: Any, warmup: int | None, timed: Sequence[int], budget_s: float,
          measure: Callable[[Any], int | None], emit: Callable[[Message], None]) -> None:
    """The reads, each announced before it starts (its sample and clocks, so the one cut off can be timed from
    outside) and reported when it ends."""
    wall = 0.0
    for k, i in enumerate([*([] if warmup is None else [warmup]), *timed]):
        queued0, cpu0, wall0 = queued_s(), time.process_time(), time.perf_counter()
        emit(("start", i, wall0, cpu0, queued0))
        sample = dataset[i]
        took = time.perf_counter() - wall0
        if warmup is not None and k == 0:
            emit(("warm",))
            continue
        emit(("done", took, time.process_time() - cpu0, queued_s() - queued0, measure(sample)))
        wall += took
        if wall >= budget_s:
            break
    emit(("end",))


def _summary(events: list[Message], cut: CutOff | None) -> TimedReads | None:
    if any(e[0] in ("failed", "cuda") for e in events) or (cut is None and not any(e[0] == "end" for e in events)):
        return None
    done = [e for e in events if e[0] == "done"]
    if not done and cut is None:  # nothing was timed
        return None
    return TimedReads(len(done), sum(e[1] for e in done), sum(e[2] for e in done), max(0.0, sum(e[3] for e in done)),
                      done[-1][4] if done else None, cut)


def _running(events: list[Message]) -> Message | None:
    """The "start" of the read still running after `events`, if one is."""
    return events[-1] if events and events[-1][0] == "start" else None


def _run_delay_s(path: str) -> float | None:
    """A thread's seconds ready to run but waiting for a CPU, from its schedstat file; None where unknown."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _in_child(dataset: Any, warmup: int | None, timed: Sequence[int], budget_s: float, deadline: float,
              measure: Callable[[Any], int | None]) -> tuple[list[Message], CutOff | None] | None:
    """The reads in a forked child that writes one JSON line per event to a pipe; killed at `deadline`, reaped.
    None when the fork fails (no memory for it under strict overcommit, no process left under a limit)."""
    r, w = os.pipe()
    parent = os.getpid()
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns on forking a process with threads: a lock another
            # thread held stays held in the child, which costs at most this deadline (the child is then killed)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child: only the reads, then os._exit (no atexit handler, no flush of the parent's buffers)
        try:
            os.close(r)
            _as_probe_child(parent)
            gc.disable()  # a collection would touch every object, copying the parent's pages (copy-on-write)
            # as in DataLoader's workers: an OpenMP pool the parent started does not survive the fork
            torch.set_num_threads(1)

            def emit(event: Message) -> None:
                os.write(w, (json.dumps(event) + "\n").encode())

            try:
                with seeded(0):
                    _read(dataset, warmup, timed, budget_s, measure, emit)
            except BaseException as e:  # reported, never raised: the parent decides without this read
                emit(("cuda",) if CUDA_IN_FORK in str(e) else ("failed",))
        finally:
            os._exit(0)
    os.close(w)
    events: list[Message] = []
    running: Message | None = None
    try:
        events = _events_until(r, deadline)
        running = _running(events)
        now = time.perf_counter()
        queued_now = _run_delay_s(f"/proc/{pid}/schedstat") if running is not None else None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        usage = _reap(pid, REAP_S if running is not None else 0.0)  # its CPU time is needed only for a read cut off
        os.close(r)
    if running is None:
        return events, None
    _, index, wall0, cpu0, queued0 = running
    cpu = None if usage is None else usage.ru_utime + usage.ru_stime - cpu0
    queued = 0.0 if queued_now is None else max(0.0, queued_now - queued0)
    return events, CutOff(index, now - wall0, max(0.0, cpu or 0.0), queued, cpu is not None)


def _as_probe_child(parent: int) -> None:
    """This child named `CHILD_NAME` and killed when `parent` dies (the training killed during the probe), not
    left blocked in a read."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(CHILD_NAME))
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(0)


def _events_until(fd: int, deadline: float) -> list[Message]:
    """The child's events as they come, until its last ("end", "failed", "cuda"), its exit or `deadline`."""
    events: list[Message] = []
    buffer = b""
    poll = select.poll()  # not select(): a training process may hold descriptors past its 1024 limit
    poll.register(fd, select.POLLIN)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0 or not poll.poll(max(1, math.ceil(1000 * left))):
            return events
        chunk = os.read(fd, 65536)
        if not chunk:  # the child died (a read crashed it): no "end", no decision
            return events
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        events.extend(tuple(json.loads(line)) for line in lines)
        if events and events[-1][0] in ("end", "failed", "cuda"):
            return events


def _reap(pid: int, within_s: float) -> Any:
    """The killed child's resource usage (`os.wait4`), reaped within `within_s`; else None, and a daemon thread
    reaps it when the kernel lets it die (no zombie left). Tearing down a child of a 235 MB process took ~14 ms."""
    stop = time.perf_counter() + within_s
    while True:
        try:
            done, _, usage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler): no usage to read
            return None
        if done:
            return usage
        if time.perf_counter() >= stop:
            threading.Thread(target=_wait_quietly, args=(pid,), daemon=True, name="trainfast-probe-reap").start()
            return None
        time.sleep(0.001)


def _wait_quietly(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


class _Abandoned(Exception):
    """Raised in the probe's thread when it reports after the deadline: it stops there, silently."""


def _in_thread(dataset: Any, warmup: int | None, timed: Sequence[int], budget_s: float, deadline: float,
               measure: Callable[[Any], int | None]) -> tuple[list[Message], CutOff | None]:
    """The reads in a daemon thread, the global RNGs seeded meanwhile and put back at `deadline`; a read still
    running then is left to finish on its own, its result and any exception dropped."""
    events: list[Message] = []
    lock, finished = threading.Lock(), threading.Event()
    abandoned = False

    def emit(event: Message) -> None:
        with lock:
            if abandoned:
                raise _Abandoned
            events.append(event)
        if event[0] in ("end", "failed"):
            finished.set()

    def run() -> None:
        try:
            _read(dataset, warmup, timed, budget_s, measure, emit)
        except _Abandoned:
            pass
        except BaseException:  # never raised in the thread: the caller decides without this read
            with contextlib.suppress(_Abandoned):
                emit(("failed",))

    thread = threading.Thread(target=run, daemon=True, name="trainfast-read-probe")
    with seeded(0):
        thread.start()
        try:
            finished.wait(max(0.0, deadline - time.perf_counter()))
        finally:
            with lock:
                abandoned = True
                taken = list(events)
                now, cpu_now = time.perf_counter(), time.process_time()
    running = _running(taken)
    if running is None:
        return taken, None
    _, index, wall0, cpu0, queued0 = running
    queued_now = _run_delay_s(f"/proc/self/task/{thread.native_id}/schedstat")
    queued = 0.0 if queued_now is None else max(0.0, queued_now - queued0)
    return taken, CutOff(index, now - wall0, max(0.0, cpu_now - cpu0), queued)
