"""Side-by-side timing: warm-up discarded, A/B runs interleaved (alternating order), median and spread.

On a shared machine one timing means little: background load drifts over seconds. Interleaving puts
every variant under the same drift, and the ratio of medians (or the median of per-round ratios)
is what stays stable from run to run.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    median: float
    low: float  # 25th percentile
    high: float  # 75th percentile
    minimum: float
    maximum: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        ordered = sorted(values)
        if len(ordered) >= 4:
            low, _, high = statistics.quantiles(ordered, n=4)
        else:
            low, high = ordered[0], ordered[-1]
        return cls(statistics.median(ordered), low, high, ordered[0], ordered[-1], len(ordered))

    def to_json(self) -> dict[str, float]:
        return {"median": self.median, "p25": self.low, "p75": self.high, "min": self.minimum, "max": self.maximum,
                "n": self.n}


def interleave(variants: dict[str, Callable[[], float]], *, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Call each variant `warmup` times (discarded), then `repeats` rounds in alternating order.

    Each variant returns its own measurement (seconds, or a rate), so it can exclude its set-up.
    """
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            results[name].append(variants[name]())
    return results


def ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Per-round ratios of two interleaved series."""
    return [a / b for a, b in zip(numerator, denominator, strict=True)]
