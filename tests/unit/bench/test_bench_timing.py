"""`trainfast.bench.timing`, on which every speed figure rests: `Spread.of` (median, quartiles, range),
`interleave` (warm-up discarded, alternating order, each variant's own measurements) and `ratios`.

Expected values are worked out by hand. Quartiles for n >= 4 are statistics.quantiles' default ("exclusive")
method: the q-th quartile sits at position q * (n + 1) / 4 of the sorted values (1-based), interpolated.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest

from trainfast.bench.timing import Spread, interleave, ratios


def spread(median: float, low: float, high: float, minimum: float, maximum: float, n: int) -> Spread:
    return Spread(median=median, low=low, high=high, minimum=minimum, maximum=maximum, n=n)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # n = 1: every figure is the one value.
        ([2.5], spread(2.5, 2.5, 2.5, 2.5, 2.5, 1)),
        # n = 2: median is the midpoint; below 4 values the quartiles fall back to min and max.
        ([3.0, 1.0], spread(2.0, 1.0, 3.0, 1.0, 3.0, 2)),
        # n = 3: the middle value; quartiles still min and max.
        ([5.0, 1.0, 3.0], spread(3.0, 1.0, 5.0, 1.0, 5.0, 3)),
        # n = 4: positions 1.25 and 3.75 -> 1 + 0.25 * 1 and 3 + 0.75 * 1.
        ([4.0, 1.0, 3.0, 2.0], spread(2.5, 1.25, 3.75, 1.0, 4.0, 4)),
        # n = 5: positions 1.5 and 4.5.
        ([50.0, 10.0, 40.0, 20.0, 30.0], spread(30.0, 15.0, 45.0, 10.0, 50.0, 5)),
        # n = 7: positions 2 and 6, exactly the 2nd and 6th values.
        ([7.0, 1.0, 6.0, 2.0, 5.0, 3.0, 4.0], spread(4.0, 2.0, 6.0, 1.0, 7.0, 7)),
        # n = 8 (sorted 1 2 3 4 8 12 16 100): positions 2.25 and 6.75 -> 2 + 0.25 * 1 and 12 + 0.75 * 4;
        # median (4 + 8) / 2: the outlier moves only the maximum.
        ([16.0, 1.0, 12.0, 2.0, 8.0, 4.0, 3.0, 100.0], spread(6.0, 2.25, 15.0, 1.0, 100.0, 8)),
    ],
    ids=["n1", "n2", "n3", "n4", "n5", "n7", "n8-outlier"],
)
def test_spread_of(values: list[float], expected: Spread) -> None:
    given = list(values)
    assert Spread.of(values) == expected
    assert values == given  # the caller's list is not sorted in place


def test_spread_quartiles_are_statistics_quantiles_for_four_or_more() -> None:
    values = [0.31, 0.29, 0.35, 0.30, 0.42, 0.28]
    low, _, high = statistics.quantiles(values, n=4)
    result = Spread.of(values)
    assert (result.low, result.high) == (low, high)
    assert result.low == pytest.approx(0.2875) and result.high == pytest.approx(0.3675)  # positions 1.75, 5.25
    assert result.median == pytest.approx(0.305)


def test_spread_of_equal_values() -> None:
    assert Spread.of([0.5] * 6) == spread(0.5, 0.5, 0.5, 0.5, 0.5, 6)


def test_spread_of_nothing_raises() -> None:
    with pytest.raises((IndexError, statistics.StatisticsError)):
        Spread.of([])


def test_spread_to_json() -> None:
    result = Spread.of([4.0, 1.0, 3.0, 2.0])
    assert result.to_json() == {"median": 2.5, "p25": 1.25, "p75": 3.75, "min": 1.0, "max": 4.0, "n": 4}
    assert list(result.to_json()) == ["median", "p25", "p75", "min", "max", "n"]


class Recorder:
    """Variants that log each call and return the next of their scripted measurements."""

    def __init__(self, scripts: dict[str, list[float]]) -> None:
        self.calls: list[str] = []
        self._left = {name: list(values) for name, values in scripts.items()}

    def variant(self, name: str) -> Callable[[], float]:
        def call() -> float:
            self.calls.append(name)
            return self._left[name].pop(0)
        return call

    def variants(self) -> dict[str, Callable[[], float]]:
        return {name: self.variant(name) for name in self._left}


def test_interleave_discards_warmup_and_alternates_the_order() -> None:
    rec = Recorder({"naive": [90.0, 91.0, 1.0, 2.0, 3.0, 4.0], "fast": [80.0, 81.0, 10.0, 20.0, 30.0, 40.0]})
    results = interleave(rec.variants(), repeats=4, warmup=2)
    assert rec.calls == ["naive", "fast", "naive", "fast",  # warm-up, twice each, in the given order
                         "naive", "fast",  # round 0: given order
                         "fast", "naive",  # round 1: reversed
                         "naive", "fast",  # round 2
                         "fast", "naive"]  # round 3
    assert results == {"naive": [1.0, 2.0, 3.0, 4.0], "fast": [10.0, 20.0, 30.0, 40.0]}
    assert list(results) == ["naive", "fast"]


def test_interleave_three_variants() -> None:
    rec = Recorder({"a": [0.0, 1.0, 2.0, 3.0], "b": [0.0, 4.0, 5.0, 6.0], "c": [0.0, 7.0, 8.0, 9.0]})
    results = interleave(rec.variants(), repeats=3)  # warmup defaults to one call each
    assert rec.calls == ["a", "b", "c", "a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert results == {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "c": [7.0, 8.0, 9.0]}


def test_interleave_without_warmup() -> None:
    rec = Recorder({"x": [1.0, 2.0], "y": [3.0, 4.0]})
    assert interleave(rec.variants(), repeats=2, warmup=0) == {"x": [1.0, 2.0], "y": [3.0, 4.0]}
    assert rec.calls == ["x", "y", "y", "x"]


def test_interleave_zero_repeats_still_warms_up() -> None:
    rec = Recorder({"x": [1.0], "y": [2.0]})
    assert interleave(rec.variants(), repeats=0) == {"x": [], "y": []}
    assert rec.calls == ["x", "y"]


def test_interleave_single_variant() -> None:
    rec = Recorder({"only": [9.0, 1.0, 2.0, 3.0]})
    assert interleave(rec.variants(), repeats=3) == {"only": [1.0, 2.0, 3.0]}
    assert rec.calls == ["only"] * 4


def test_ratios_are_per_round() -> None:
    assert ratios([2.0, 9.0, 1.0], [1.0, 3.0, 4.0]) == [2.0, 3.0, 0.25]
    assert ratios([], []) == []


@pytest.mark.parametrize(("numerator", "denominator"), [([1.0, 2.0], [1.0]), ([1.0], [1.0, 2.0]), ([], [1.0])])
def test_ratios_of_unequal_lengths_raise(numerator: list[float], denominator: list[float]) -> None:
    with pytest.raises(ValueError):
        ratios(numerator, denominator)


def test_interleave_then_ratios() -> None:
    rec = Recorder({"naive": [0.0, 3.0, 6.0, 9.0], "fast": [0.0, 1.0, 2.0, 3.0]})
    results = interleave(rec.variants(), repeats=3)
    assert ratios(results["naive"], results["fast"]) == [3.0, 3.0, 3.0]
    assert Spread.of(ratios(results["naive"], results["fast"])) == spread(3.0, 3.0, 3.0, 3.0, 3.0, 3)
