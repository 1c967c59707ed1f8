"""analysis.py: percentiles, Stats, the GPU saw-tooth detector and the growth slope, from tables."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from trainfast.monitor.analysis import (
    Stats,
    detect_sawtooth,
    growth_per_minute,
    percentile,
    stats,
    sustained_growth_per_minute,
)


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([5.0], 0, 5.0),
    ([5.0], 50, 5.0),
    ([5.0], 100, 5.0),
    ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
    ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([4.0, 1.0, 3.0, 2.0], 50, 2.5),  # order does not matter
    ([1.0, 2.0, 3.0, 4.0, 5.0], 25, 2.0),
    ([0.0, 10.0], 5, 0.5),
    ([0.0, 10.0], 95, 9.5),
    ([-3.0, -1.0], 50, -2.0),
    ([7.0, 7.0, 7.0], 37.5, 7.0),
])
def test_percentile(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(-50, 50) for _ in range(n)]
        for q in (0, 5, 12.5, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.parametrize(("values", "q", "match"), [
    ([], 50, "no values"),
    ([1.0], -1, "got -1"),
    ([1.0], 100.5, "got 100.5"),
    ([1.0], math.nan, "got nan"),
])
def test_percentile_rejects(values: list[float], q: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        percentile(values, q)


def test_stats() -> None:
    result = stats([1.0, 2.0, 3.0, 4.0])
    assert (result.mean, result.minimum, result.maximum, result.last, result.n) == (2.5, 1.0, 4.0, 4.0, 4)
    assert [result.p5, result.p95] == pytest.approx([1.15, 3.85])
    assert stats([3.0]) == Stats(mean=3.0, p5=3.0, p95=3.0, minimum=3.0, maximum=3.0, last=3.0, n=1)
    assert stats([9.0, 1.0]).last == 1.0  # last is the newest, not the largest


def test_stats_to_json_round_trips() -> None:
    result = stats([1.0, 2.0, 3.0])
    payload = result.to_json()
    assert set(payload) == {"mean", "p5", "p95", "minimum", "maximum", "last", "n"}
    assert Stats(**json.loads(json.dumps(payload))) == result


def test_stats_frozen_and_empty() -> None:
    with pytest.raises(AttributeError):
        stats([1.0]).mean = 2.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="no values"):
        stats([])


INPUT_BOUND = [0.0, 95.0] * 5                                   # the tutorial's 0 % <-> 95 % swing
INPUT_BOUND_RAMPS = [2, 10, 50, 90, 97, 96, 60, 20, 3, 1] * 4   # passing through the middle on the way
NOISY_MIDDLE = [40.0, 60.0, 45.0, 55.0, 50.0] * 10              # compute-bound small model, ~50 %
AROUND_LOW = [25.0, 35.0] * 20                                  # crosses `low` only: no busy phase
AROUND_HIGH = [65.0, 75.0] * 20                                 # crosses `high` only: no idle phase
MOSTLY_BUSY_WITH_DIPS = ([95.0] * 20 + [5.0]) * 3 + [95.0] * 20  # 3 checkpoint dips in 83 samples (< 10 %)


@pytest.mark.parametrize(("values", "kwargs", "expected"), [
    (INPUT_BOUND, {}, True),
    (INPUT_BOUND_RAMPS, {}, True),
    ([95.0, 0.0] * 4, {}, True),                       # starting busy: cycles L->H->L still counted (3)
    ([0.0, 95.0, 0.0, 95.0, 0.0, 95.0, 0.0], {}, True),  # exactly 3 cycles
    ([0.0, 95.0, 0.0, 95.0, 0.0], {}, False),           # only 2 cycles ...
    ([0.0, 95.0, 0.0, 95.0, 0.0], {"min_cycles": 2}, True),  # ... enough when 2 are asked for
    ([0.0, 95.0, 95.0, 0.0] * 3 + [0.0], {}, True),
    ([0.0, 50.0, 0.0, 50.0, 0.0, 50.0, 0.0], {}, False),  # never busy
    ([0.0, 50.0, 0.0, 50.0, 0.0, 50.0, 0.0], {"high": 40.0}, True),
    ([95.0] * 50, {}, False),                           # steady busy: compute-bound, the goal
    ([2.0] * 50, {}, False),                            # steady idle
    (NOISY_MIDDLE, {}, False),
    (AROUND_LOW, {}, False),
    (AROUND_HIGH, {}, False),
    (MOSTLY_BUSY_WITH_DIPS, {}, False),
    (MOSTLY_BUSY_WITH_DIPS, {"min_share": 0.03, "min_cycles": 2}, True),  # 2 complete dips between busy runs
    ([], {}, False),
    ([0.0], {}, False),
])
def test_detect_sawtooth(values: list[float], kwargs: dict[str, float], expected: bool) -> None:
    assert detect_sawtooth(values, **kwargs) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"low": 70.0, "high": 30.0}, "low=70.0, high=30.0"),
    ({"low": 50.0, "high": 50.0}, "low=50.0, high=50.0"),
    ({"min_cycles": 0}, "got 0"),
    ({"min_share": 0.0}, "got 0.0"),
    ({"min_share": 0.6}, "got 0.6"),
])
def test_detect_sawtooth_rejects(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        detect_sawtooth(INPUT_BOUND, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("times", "values", "expected"), [
    ([0.0, 60.0], [0.0, 100.0], 100.0),
    ([0.0, 1.0, 2.0, 3.0], [10.0, 12.0, 14.0, 16.0], 120.0),      # 2 per second
    ([0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0], 0.0),
    ([0.0, 30.0, 60.0], [300.0, 200.0, 100.0], -200.0),           # shrinking
    ([0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 0.0, 2.0], 24.0),           # least squares, not end points
    ([5.0, 5.0, 5.0], [1.0, 2.0, 3.0], 0.0),                      # one instant: no slope
    ([], [], 0.0),
    ([1.0], [2.0], 0.0),
])
def test_growth_per_minute(times: list[float], values: list[float], expected: float) -> None:
    assert growth_per_minute(times, values) == pytest.approx(expected)


def test_growth_per_minute_matches_numpy_polyfit() -> None:
    rng = random.Random(1)
    times = sorted(rng.uniform(0, 600) for _ in range(50))
    values = [1e9 + 2e5 * t + rng.gauss(0, 1e6) for t in times]  # ~12 MB/min of RSS growth plus noise
    slope = float(np.polyfit(times, values, 1)[0])
    assert growth_per_minute(times, values) == pytest.approx(slope * 60, rel=1e-9)


def test_growth_per_minute_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="got 3 and 2"):
        growth_per_minute([0.0, 1.0, 2.0], [1.0, 2.0])


MIB = 2**20
TIMES = [float(t) for t in range(12)]  # one sample a second


@pytest.mark.parametrize(("values", "counts", "since", "expected"), [
    # copy-on-read: 2 workers at 200 MiB growing 20 MiB/s the whole time -> 1200 MiB/min
    ([200 * MIB + 20 * MIB * t for t in TIMES], [2] * 12, 0.0, 1200 * MIB),
    # workers starting (count 0 -> 2) add their whole RSS: not growth; the steady stretch after is flat
    ([0.0] * 3 + [400 * MIB] * 9, [0] * 3 + [2] * 9, 0.0, 0.0),
    # non-persistent workers restarting at an epoch boundary (count 2 -> 0 -> 2): only the last stretch counts
    ([300 * MIB + 5 * MIB * t for t in TIMES[:4]] + [0.0] + [250 * MIB] * 7, [2] * 4 + [0] + [2] * 7, 0.0, 0.0),
    # a cache warming up during the warm-up, flat once measuring starts
    ([100 * MIB + min(t, 3) * 50 * MIB for t in TIMES], [2] * 12, 4.0, 0.0),
    # growth only in the first half: not sustained
    ([200 * MIB + min(t, 5) * 20 * MIB for t in TIMES], [2] * 12, 0.0, 0.0),
    # tiny growth against a large RSS (< 5 %): not copy-on-read
    ([4000 * MIB + 1 * MIB * t for t in TIMES], [4] * 12, 0.0, 0.0),
    # too short to tell (after `since`: 4 samples, 3 s)
    ([200 * MIB + 20 * MIB * t for t in TIMES], [2] * 12, 8.0, None),
    # no workers at the end
    ([0.0] * 12, [0] * 12, 0.0, None),
])
def test_sustained_growth_per_minute(values: list[float], counts: list[int], since: float,
                                     expected: float | None) -> None:
    found = sustained_growth_per_minute(TIMES, values, [float(c) for c in counts], since=since)
    assert found == (None if expected is None else pytest.approx(expected))


def test_sustained_growth_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="same length"):
        sustained_growth_per_minute([0.0, 1.0], [1.0, 2.0], [2.0], since=0.0)


def test_sustained_growth_ignores_the_workers_shutting_down_at_the_end() -> None:
    """The run stopped and its workers exited before the last sample: the growth before still counts."""
    values = [200 * MIB + 20 * MIB * t for t in TIMES[:11]] + [0.0]
    counts = [2.0] * 11 + [0.0]
    assert sustained_growth_per_minute(TIMES, values, counts, since=0.0) == pytest.approx(1200 * MIB)


def test_sustained_growth_splits_at_workers_replaced_between_samples() -> None:
    """Non-persistent workers restarted every 4 s, each time from a larger parent: the count never shows it and the
    sum steps up at each restart, which the count alone reads as growth; `started` ends the stretch there."""
    values = [400 * MIB] * 4 + [500 * MIB] * 4 + [600 * MIB] * 4
    counts, started = [2.0] * 12, [2.0] * 4 + [4.0] * 4 + [6.0] * 4
    assert sustained_growth_per_minute(TIMES, values, counts, since=0.0) > 100 * MIB  # the trap
    assert sustained_growth_per_minute(TIMES, values, counts, since=0.0, started=started) is None  # 4 points, 3 s
    assert sustained_growth_per_minute(TIMES, values, counts, since=0.0, started=[2.0] * 4 + [4.0] * 8) == 0.0
    # copy-on-read in restarted workers: the new ones' own growth is measured, not the restart's drop
    growing = [300 * MIB] * 4 + [50 * MIB + 20 * MIB * (t - 4) for t in TIMES[4:]]
    assert sustained_growth_per_minute(TIMES, growing, counts, since=0.0, started=[2.0] * 4 + [4.0] * 8) == (
        pytest.approx(1200 * MIB))


def test_sustained_growth_is_the_slower_half() -> None:
    """A one-off step (a buffer filled once) raises one half: a fit over the stretch would make it ~800 MiB/min."""
    values = [200 * MIB + 0.1 * MIB * t + (100 * MIB if t >= 5 else 0.0) for t in TIMES]
    assert sustained_growth_per_minute(TIMES, values, [2.0] * 12, since=0.0) == pytest.approx(6 * MIB)
    assert growth_per_minute(TIMES, values) > 600 * MIB


def test_sustained_growth_rejects_mismatched_started() -> None:
    with pytest.raises(ValueError, match="started must have the same length"):
        sustained_growth_per_minute([0.0, 1.0], [1.0, 2.0], [2.0, 2.0], since=0.0, started=[2.0])
