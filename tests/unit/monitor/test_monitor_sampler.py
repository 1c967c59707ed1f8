"""sampler.py: the Monitor thread, its ring buffer, summaries, failure isolation and clean shutdown."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable

import pytest
import torch

from trainfast.monitor import FakeSource, Monitor, NvmlSource, Stats
from trainfast.monitor.analysis import stats
from trainfast.monitor.sampler import THREAD_NAME

FAST = 0.01  # seconds between samples in these tests


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the monitor"
        time.sleep(0.002)


def monitor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


class Boom:
    """A source that works `ok_calls` times, then raises."""

    def __init__(self, ok_calls: int = 2) -> None:
        self.name = "boom"
        self.available = True
        self.ok_calls = ok_calls
        self.calls = 0
        self.closed = False

    def sample(self) -> dict[str, float]:
        self.calls += 1
        if self.calls > self.ok_calls:
            raise RuntimeError("sensor fell off")
        return {"boom.value": 1.0}

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("interval_s", [0, -1, -0.5, math.nan, math.inf, "0.5", True, None])
def test_rejects_bad_interval(interval_s: object) -> None:
    with pytest.raises(ValueError, match=r"interval_s must be a finite number of seconds > 0.*got " + repr(interval_s)):
        Monitor(interval_s=interval_s, sources=[])  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -5, 1.5, True, "10"])
def test_rejects_bad_capacity(capacity: object) -> None:
    with pytest.raises(ValueError, match=r"capacity must be an int >= 1.*got " + repr(capacity)):
        Monitor(capacity=capacity, sources=[])  # type: ignore[arg-type]


def test_summary_and_series_match_the_replayed_values() -> None:
    fake = FakeSource({"a": [1.0, 2.0, 3.0, 4.0], "b": [10.0]})
    with Monitor(interval_s=FAST, sources=[fake]) as monitor:
        wait_until(lambda: fake.calls >= 6)
    n = len(monitor.samples())
    assert n == fake.calls >= 6  # every sample() call reached the buffer
    expected_a = ([1.0, 2.0, 3.0] + [4.0] * n)[:n]
    times, values = monitor.series("a")
    assert values == expected_a
    assert times == sorted(times) and 0.0 <= times[0] < 1.0  # seconds since start(), not monotonic time
    assert monitor.metrics() == ["a", "b"]
    summary = monitor.summary()
    assert list(summary) == ["a", "b"]
    assert summary["a"] == stats(expected_a)
    assert summary["b"] == Stats(mean=10.0, p5=10.0, p95=10.0, minimum=10.0, maximum=10.0, last=10.0, n=n)


def test_samples_are_evenly_spaced() -> None:
    fake = FakeSource({"a": [0.0]})
    with Monitor(interval_s=0.02, sources=[fake]) as monitor:
        wait_until(lambda: fake.calls >= 6)
    times, _ = monitor.series("a")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # On a fixed schedule the mean gap is the interval (a late wake-up shortens only the next gap); the upper
    # bound is loose for loaded CI machines.
    assert 0.015 <= sum(gaps) / len(gaps) <= 0.2


def test_ring_buffer_keeps_the_newest_capacity_samples() -> None:
    fake = FakeSource({"i": [float(i) for i in range(1000)]})
    with Monitor(interval_s=0.002, capacity=3, sources=[fake]) as monitor:
        wait_until(lambda: fake.calls >= 10)
    calls = fake.calls
    assert len(monitor.samples()) == 3
    assert monitor.series("i")[1] == [calls - 3.0, calls - 2.0, calls - 1.0]
    assert monitor.summary()["i"].n == 3


def test_samples_returns_a_copy() -> None:
    fake = FakeSource({"a": [1.0]})
    with Monitor(interval_s=FAST, sources=[fake]) as monitor:
        wait_until(lambda: fake.calls >= 1)
    taken_at, values = monitor.samples()[0]
    values["a"] = 99.0
    values["injected"] = 1.0
    assert monitor.samples()[0] == (taken_at, {"a": 1.0})


def test_context_manager_stops_and_joins_the_thread() -> None:
    fake = FakeSource({"a": [1.0]})
    with Monitor(interval_s=FAST, sources=[fake]) as monitor:
        assert monitor.running
        [thread] = monitor_threads()
        assert thread.daemon  # never keeps the interpreter alive
    assert not monitor.running
    assert not thread.is_alive()
    assert monitor_threads() == []
    assert fake.closed


def test_context_manager_stops_when_the_body_raises() -> None:
    with pytest.raises(KeyError), Monitor(interval_s=FAST, sources=[FakeSource({"a": [1.0]})]):
        raise KeyError("training failed")
    assert monitor_threads() == []


def test_start_and_stop_are_idempotent_and_a_monitor_runs_once() -> None:
    fake = FakeSource({"a": [1.0]})
    monitor = Monitor(interval_s=FAST, sources=[fake])
    assert not monitor.running and monitor.samples() == []
    try:
        assert monitor.start() is monitor
        assert monitor.start() is monitor
        assert len(monitor_threads()) == 1
    finally:
        monitor.stop()
    monitor.stop()
    assert monitor_threads() == []
    with pytest.raises(RuntimeError, match="runs once"):
        monitor.start()
    assert monitor_threads() == []


def test_stop_before_start_closes_the_sources() -> None:
    fake = FakeSource({"a": [1.0]})
    monitor = Monitor(interval_s=FAST, sources=[fake])
    monitor.stop()
    assert fake.closed and monitor_threads() == []


def test_a_raising_source_is_disabled_and_recorded_without_killing_the_thread() -> None:
    boom, fake = Boom(ok_calls=2), FakeSource({"a": [1.0]})
    with Monitor(interval_s=FAST, sources=[boom, fake]) as monitor:
        wait_until(lambda: fake.calls >= 6)
        assert monitor.running
        assert monitor.errors == {"boom": "RuntimeError: sensor fell off"}
        assert monitor.sources == (fake,)
        assert boom.closed
    assert boom.calls == 3  # never asked again after it raised
    assert monitor.summary()["boom.value"].n == 2
    assert monitor.summary()["a"].n == fake.calls


def test_unavailable_sources_are_listed_not_sampled() -> None:
    off = FakeSource({"x": [1.0]}, name="off")
    off.available = False
    off.unavailable_reason = "no such sensor here"
    on = FakeSource({"a": [1.0]})
    with Monitor(interval_s=FAST, sources=[off, on]) as monitor:
        wait_until(lambda: on.calls >= 2)
    assert monitor.unavailable == {"off": "no such sensor here"}
    assert monitor.sources == (on,)
    assert off.calls == 0 and off.closed
    assert monitor.metrics() == ["a"]


def test_monitor_works_with_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails, as on a machine without nvidia-ml-py
    fake = FakeSource({"a": [1.0]})
    with Monitor(interval_s=FAST, sources=[NvmlSource(), fake]) as monitor:
        wait_until(lambda: fake.calls >= 2)
    assert "pip install nvidia-ml-py" in monitor.unavailable["nvml"]
    assert monitor.metrics() == ["a"]
    assert monitor.gpu_sawtooth() == {}


def test_default_sources_on_this_machine() -> None:
    with Monitor(interval_s=FAST) as monitor:
        wait_until(lambda: len(monitor.samples()) >= 2)
    assert monitor_threads() == []
    assert monitor.errors == {}
    assert {"cpu.percent", "ram.used_bytes", "proc.rss_bytes", "workers.count"} <= set(monitor.metrics())
    assert 0.0 <= monitor.summary()["cpu.percent"].mean <= 100.0
    if not torch.cuda.is_available():
        assert set(monitor.unavailable) == {"nvml", "torch.cuda"}
        assert all(monitor.unavailable.values())


def test_gpu_sawtooth_flags_only_gpu_utilisation_that_swings() -> None:
    swing = [0.0, 95.0] * 500
    fake = FakeSource({"gpu0.util": swing, "gpu1.util": [90.0], "gpu0.mem_used_bytes": swing, "cpu.percent": swing})
    with Monitor(interval_s=0.002, sources=[fake]) as monitor:
        wait_until(lambda: fake.calls >= 10)
    assert monitor.gpu_sawtooth() == {"gpu0.util": True, "gpu1.util": False}


def test_series_of_an_unknown_metric_names_the_recorded_ones() -> None:
    fake = FakeSource({"a": [1.0], "b": [2.0]})
    with Monitor(interval_s=FAST, sources=[fake]) as monitor:
        wait_until(lambda: fake.calls >= 1)
    with pytest.raises(KeyError, match=r"'gpu0.util'.*\['a', 'b'\]"):
        monitor.series("gpu0.util")
