"""Workers that wait on reads: told from busy ones by their measured CPU share, given as many batches in flight as
the step needs (Little's law) beyond the cores, and never told "fewer workers" or "more would share the cores"."""

from __future__ import annotations

import math
import time

import pytest
from test_diagnose_recommend import evidence, ids, loader

from trainfast.diagnose.capture.worker_clock import WorkerClock
from trainfast.diagnose.evidence.workers import WorkerTime, from_clock, from_loader, from_monitor, of_training
from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.fixes.notes import unaddressed_input as why_no_input_fix
from trainfast.diagnose.records.steps import Fractions
from trainfast.loader.latency import MAX_THREADS as MAX_WAITING_WORKERS
from trainfast.monitor import FakeSource, Monitor
from trainfast.monitor.sources import PsutilSource

WAITING = WorkerTime(busy=0.02, queued=0.0, workers=2, source="the workers themselves", batch_s=0.64)
BUSY = WorkerTime(busy=0.9, queued=0.05, workers=2, source="the OS")
# 2 workers, a 320 ms step of which 8 ms is the model step: each worker spends 640 ms on a batch
INPUT_BOUND = Fractions(0.975, 0, 0, 0.025)


def waiting_run(**overrides: object) -> object:
    values: dict[str, object] = {
        "verdict": "input-bound", "fractions": INPUT_BOUND, "step_s": 0.32, "cpus": 2, "threads": 2,
        "loaders": (loader(num_workers=2, prefetch_factor=2),), "workers": WAITING}
    return evidence(**(values | overrides))  # type: ignore[arg-type]


def test_waiting_workers_get_littles_law_concurrency_beyond_the_cores() -> None:
    top = recommend(waiting_run())[0]  # type: ignore[arg-type]
    # a batch: 640 ms inside a worker, 12.8 ms of it on a core; the step's floor on 2 cores: (12.8 + 2 x 8) / 2 ms
    floor = (0.02 * 0.64 + 0.008 * 2) / 2
    k = math.ceil(0.64 / floor)
    assert top.id == "num_workers" and f"num_workers={k}" in top.fix and k > 2
    assert top.overrides == {"num_workers": k, "persistent_workers": True}  # no thread cut: they hold no core
    assert top.expected_gain == pytest.approx(0.32 / max(floor, 0.64 / k))
    assert top.gain_basis == "measured"
    assert "busy 2% of the time" in top.why and "Little's law" in top.why and "memory in flight" in top.why


def test_busy_workers_keep_the_core_bound_rule() -> None:
    assert "num_workers" not in ids(waiting_run(workers=BUSY))  # type: ignore[arg-type]  # 2 busy on 2 cores
    rec = next(r for r in recommend(waiting_run(workers=BUSY, cpus=8)) if r.id == "num_workers")  # type: ignore[arg-type]
    assert "Little's law" not in rec.why and rec.overrides is not None and rec.overrides["num_workers"] <= 8


def test_waiting_workers_are_capped() -> None:
    e = waiting_run(fractions=Fractions(0.999, 0, 0, 0.001), step_s=10.0, workers=WorkerTime(0.0, 0.0, 2, "os"))
    top = recommend(e)[0]  # type: ignore[arg-type]
    assert f"num_workers={MAX_WAITING_WORKERS}" in top.fix and "capped" in top.why


def test_never_fewer_workers_or_fewer_threads_for_workers_that_wait() -> None:
    many = evidence(loaders=(loader(num_workers=8),), cpus=2, threads=2)
    assert "num_workers" in ids(many)  # not measured: the core-bound rule as before (cpu_threads needs its trial)
    waiting = evidence(loaders=(loader(num_workers=8),), cpus=2, threads=2, workers=WAITING)
    assert "num_workers" not in ids(waiting) and "cpu_threads" not in ids(waiting)
    queued = evidence(loaders=(loader(num_workers=8),), cpus=2, threads=2,
                      workers=WorkerTime(busy=0.25, queued=0.6, workers=8, source="the OS"))
    assert "num_workers" in ids(queued)  # they do take turns on the cores


def test_no_input_fix_note_never_says_more_workers_would_share_the_cores_of_waiting_ones() -> None:
    e = waiting_run(fractions=Fractions(0.5, 0, 0, 0.5), loaders=(loader(num_workers=2),))
    assert "would only share the same cores" not in (why_no_input_fix(e, []) or "")  # type: ignore[arg-type]
    busy = waiting_run(fractions=Fractions(0.5, 0, 0, 0.5), loaders=(loader(num_workers=2),), workers=BUSY)
    assert "would only share the same cores" in (why_no_input_fix(busy, []) or "")  # type: ignore[arg-type]


def test_phrases_tell_waiting_from_busy_from_queued() -> None:
    assert "wait on reads" in WAITING.phrase() and "busy 2%" in WAITING.phrase()
    assert "busy making batches" in BUSY.phrase() and "busy 90%" in BUSY.phrase()
    assert "wait for a core" in WorkerTime(0.3, 0.6, 8, "os").phrase()
    assert WAITING.to_json()["wait"] is True and BUSY.to_json()["wait"] is False


def test_from_monitor_reads_the_measured_window_only() -> None:
    # samples at 0.1 s intervals: the workers idle at first (start-up), then 10 % busy and 5 % queued for a core
    series = {"workers.count": [2] * 6, "workers.cpu_percent": [0, 0, 20, 20, 20, 20],
              "workers.queued_percent": [0, 0, 10, 10, 10, 10]}
    with Monitor(interval_s=0.05, sources=[FakeSource(series)]) as monitor:
        time.sleep(0.4)
    started = monitor.started_at
    assert started is not None
    times, _ = monitor.series("workers.count")
    got = from_monitor(monitor, started + times[1], started + times[5])
    assert got is not None and got.busy == pytest.approx(0.1) and got.queued == pytest.approx(0.05)
    assert got.wait and got.workers == pytest.approx(2)
    assert from_monitor(monitor, started + times[4], started + times[5]) is None  # one sample: not enough
    assert from_monitor(None, 0.0, 1.0) is None


def test_from_loader_uses_the_threads_own_account() -> None:
    threads = loader(kind="trainfast ThreadLoader (threads)", num_workers=8, fetch_cpu_s=0.4, fetch_wall_s=10.0)
    got = from_loader(threads)
    assert got is not None and got.busy == pytest.approx(0.04) and got.workers == 8
    assert "loader's threads" in got.who
    main = from_loader(loader(num_workers=0, fetch_cpu_s=0.9, fetch_wall_s=1.0))
    assert main is not None and not main.wait and "main thread" in main.source
    assert from_loader(loader(num_workers=2)) is None  # processes: the OS tells
    assert of_training([threads], None, None, None) == got


def test_psutil_source_reads_the_workers_run_queue_delay() -> None:
    import multiprocessing

    source = PsutilSource(per_core=False)
    context = multiprocessing.get_context("fork")
    child = context.Process(target=time.sleep, args=(0.4,))
    child.start()
    try:
        source.sample()  # primes the child's counters
        time.sleep(0.1)
        out = source.sample()
    finally:
        child.join()
    assert out["workers.count"] >= 1
    if "workers.queued_percent" in out:  # Linux with schedstat
        assert 0.0 <= out["workers.queued_percent"] < 50.0  # a sleeping child waits for no core


def _two_batches(clock: WorkerClock) -> None:
    for _ in range(2):
        with clock.timed():
            time.sleep(0.02)  # waits: no CPU


def test_worker_clock_sums_what_forked_workers_timed() -> None:
    import multiprocessing

    clock = WorkerClock()
    try:
        before = clock.totals()
        children = [multiprocessing.get_context("fork").Process(target=_two_batches, args=(clock,)) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join()
        got = clock.totals().since(before)
        assert got.batches == 4 and got.workers == 2
        assert 0.08 <= got.wall_s < 1.0 and got.cpu_s < 0.5 * got.wall_s
        assert got.queued_s is None or 0 <= got.queued_s < got.wall_s
        time_of = from_clock(got, workers=2)
        assert time_of.wait and time_of.batch_s == pytest.approx(got.wall_s / 4)
    finally:
        clock.close()


def test_bursty_arrivals_are_judged_on_the_mean_step() -> None:
    """8 waiting workers deliver 8 batches at once, then none for a batch's time: the median step is a short one."""
    waiting = WorkerTime(busy=0.01, queued=0.0, workers=8, source="the workers themselves", batch_s=0.65)
    e = waiting_run(loaders=(loader(num_workers=8, prefetch_factor=2),), workers=waiting, step_s=0.0084,
                    step_mean_s=0.085, fractions=Fractions(0.92, 0, 0, 0.08))
    top = recommend(e)[0]  # type: ignore[arg-type]
    assert top.id == "num_workers" and top.overrides is not None and top.overrides["num_workers"] > 8
    assert top.expected_gain is not None and top.expected_gain > 3


def test_a_batch_time_derived_from_the_step_is_an_estimate() -> None:
    assert recommend(waiting_run())[0].gain_basis == "measured"  # type: ignore[arg-type]  # timed in the workers
    untimed = WorkerTime(busy=0.02, queued=0.0, workers=2, source="the OS")  # spawned workers: no batch time
    derived = recommend(waiting_run(workers=untimed))[0]  # type: ignore[arg-type]
    assert derived.id == "num_workers" and derived.gain_basis == "estimate"
    assert "--verify" in (derived.basis_reason or "")
