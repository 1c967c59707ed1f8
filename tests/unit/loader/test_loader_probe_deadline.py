"""timed_reads.py: the read probe of `make_loader(workers="auto")` returns within about a second whatever a read does
(a storage stall of 20 s, a read that never returns); a read still running then counts as waiting up to the deadline
and is named in the plan; a read that ends late changes nothing for the caller (its RNG streams, the probe, no
exception); the forked child runs no exit handler and flushes none of the parent's buffers; a read that needs CUDA,
which a forked child cannot use, is timed in a thread."""

from __future__ import annotations

import atexit
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset

from trainfast.loader import ThreadLoader, make_loader
from trainfast.loader.latency import probe_reads
from trainfast.loader.timed_reads import CUDA_IN_FORK, can_fork

# probe_reads(n=2000) reads sample 0 untimed, then 222, 444, ...: a dataset slow at 444 is cut off at its 2nd timed
# read, one read finished before it
N, SLOW = 2000, 444
# The probes called directly here: short, to keep the tests fast, but long enough for the reads to reach sample
# 444 with two busy loops beside the suite (the fork, the child's start and 2 reads).
DEADLINE_S = 0.5
needs_fork = pytest.mark.skipif(not can_fork(), reason="the reads run in a forked child on Linux only")
modes = pytest.mark.parametrize("fork", [pytest.param(True, marks=needs_fork), False], ids=["fork", "thread"])


class Reads(Dataset[torch.Tensor]):
    """Sample i: [i, a draw from each global RNG], after `stall_s` when `slow(i)` (a storage stall), at once
    otherwise; `ended` is set when a stalled read returns (in this process)."""

    def __init__(self, stall_s: float = 0.0, slow: int = SLOW, *, seven: bool = False) -> None:
        self.stall_s, self.slow, self.seven = stall_s, slow, seven
        self.ended = threading.Event()

    def __len__(self) -> int:
        return N

    def stalls(self, i: int) -> bool:
        return i % 7 == 0 if self.seven else i == self.slow

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.stalls(i):
            self.stall(i)
        return torch.tensor([float(i), random.random(), float(np.random.rand()), float(torch.rand(()))])

    def stall(self, i: int) -> None:
        time.sleep(self.stall_s)
        self.ended.set()


class Hangs(Reads):
    """The slow read never returns until `release` is set (the test's teardown)."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    def stall(self, i: int) -> None:
        self.release.wait()


class LateFailure(Reads):
    """The slow read draws from every global RNG after its stall, then raises."""

    def stall(self, i: int) -> None:
        time.sleep(self.stall_s)
        random.random(), np.random.rand(), torch.rand(())
        self.ended.set()
        raise OSError("connection reset, after the probe had gone on")


class Spins(Hangs):
    """The slow read keeps the CPU busy (a huge decode) until `release` is set."""

    def stall(self, i: int) -> None:
        while not self.release.is_set():
            pass


class NeedsCuda(Reads):
    """Every read in a forked child fails as torch's CUDA does there when the parent had initialised it."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()

    def __getitem__(self, i: int) -> torch.Tensor:
        if os.getpid() != self.pid:
            raise RuntimeError(f"{CUDA_IN_FORK}. To use CUDA with multiprocessing, you must use the 'spawn' "
                               "start method")
        return super().__getitem__(i)


class Named(Reads):
    """Writes the name of the process its reads run in to `path`."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __getitem__(self, i: int) -> torch.Tensor:
        self.path.write_text(psutil.Process().name())
        return super().__getitem__(i)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event set at the test's end, which lets a read blocked on it (in a thread) return."""
    event = threading.Event()
    yield event
    event.set()


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def seed(value: int = 1) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def expected_draws() -> tuple[float, float, float]:
    seed()
    return draws()


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


@pytest.mark.slow
def test_make_loader_returns_within_2_s_of_a_20_s_read_and_names_it() -> None:
    """Before the deadline, this took 20.0 s: the read of sample 0 (one in seven stalls 20 s) was awaited."""
    want, before = expected_draws(), children()
    seed()
    start = time.perf_counter()
    loader = make_loader(Reads(20.0, seven=True), 8, device="cpu", workers="auto")
    took = time.perf_counter() - start
    assert took < 2.0, took
    assert draws() == want  # the caller's RNG streams as if no read had run
    assert isinstance(loader, ThreadLoader) and loader.plan.backend == "threads"  # a stall waits: threads
    text = loader.plan.describe()
    assert "1 read (sample 0) still running after" in text and "reads wait" in text, text
    assert children() <= before  # the child killed and reaped, no zombie
    loader.close()


@modes
def test_a_read_that_never_returns_is_cut_off_at_the_deadline(fork: bool, release: threading.Event) -> None:
    start = time.perf_counter()
    probe = probe_reads(Hangs(release), N, deadline_s=DEADLINE_S, fork=fork)
    took = time.perf_counter() - start
    assert took < DEADLINE_S + 0.5
    assert probe is not None and probe.reads == 1 and probe.waiting  # sample 222 read, 444 cut off
    cut = probe.cut_off
    assert cut is not None and cut.index == SLOW and cut.cpu_known and 0 < cut.wall_s < took
    assert probe.sample_bytes == 4 * 4  # from the read that finished
    text = probe.describe()
    assert text.startswith("1 read(s) of ") and f"1 read (sample {SLOW}) still running" in text, text


@modes
def test_a_read_cut_off_while_busy_on_the_cpu_counts_as_busy(fork: bool, release: threading.Event) -> None:
    probe = probe_reads(Spins(release), N, deadline_s=DEADLINE_S, fork=fork)
    release.set()
    assert probe is not None and probe.cut_off is not None and probe.cut_off.index == SLOW
    # on a machine whose CPUs other work holds, the time queued for one explains the rest
    assert probe.busy > 0.5 or (probe.cpu_s + probe.queued_s) / probe.wall_s > 0.5, probe
    assert not probe.waiting or probe.queued_s > 0


@needs_fork
def test_a_read_that_ends_late_in_the_child_changes_nothing_here() -> None:
    """The late read draws from every global RNG and raises after the probe returned: in the forked child, killed
    at the deadline, it never does."""
    want = expected_draws()
    seed()
    dataset = LateFailure(0.3, slow=0)  # the first read, reached as soon as the child starts
    probe = probe_reads(dataset, N, deadline_s=0.2, fork=True)
    time.sleep(0.2)  # by now the read would have drawn and raised
    assert draws() == want
    assert probe is not None and probe.cut_off is not None and probe.cut_off.index == 0


def test_a_read_that_ends_late_in_a_thread_raises_nothing() -> None:
    """Where there is no fork: the late read's exception is dropped in its thread (pytest fails a test whose thread
    raised), and the probe the caller has stays as it was."""
    dataset = LateFailure(0.2, slow=0)
    probe = probe_reads(dataset, N, deadline_s=0.1, fork=False)
    assert probe is not None and probe.cut_off is not None
    assert dataset.ended.wait(5)
    time.sleep(0.01)  # the thread raises and ends
    assert probe.reads == 0 and probe.cut_off.index == 0 and probe.sample_bytes is None


@needs_fork
def test_the_child_runs_no_exit_handler_and_flushes_none_of_the_parents_buffers(tmp_path: Path) -> None:
    """It is also named, so that a process monitor tells it from a loader worker."""
    marker, written, name = tmp_path / "atexit", tmp_path / "buffered", tmp_path / "name"

    def at_exit() -> None:
        marker.write_text("ran")

    atexit.register(at_exit)
    try:
        with open(written, "w", buffering=1 << 16) as f:
            f.write("once\n")  # still in this process's buffer when it forks
            probe = probe_reads(Named(name), N, fork=True)
    finally:
        atexit.unregister(at_exit)
    assert probe is not None and probe.cut_off is None and probe.reads >= 1
    assert written.read_text() == "once\n" and not marker.exists()
    assert name.read_text() == "trainfast-probe"


@needs_fork
def test_a_read_that_needs_cuda_is_timed_in_a_thread() -> None:
    probe = probe_reads(NeedsCuda(), N, fork=True)
    assert probe is not None and probe.reads >= 1 and probe.cut_off is None


@needs_fork
def test_reads_are_timed_in_a_thread_where_the_fork_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork refused for memory (strict overcommit) or a process limit; no twin: a machine-wide limit would stop
    the other tests' processes too."""

    def refused() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refused)
    probe = probe_reads(Reads(), N, fork=True)
    assert probe is not None and probe.reads >= 1 and probe.cut_off is None
