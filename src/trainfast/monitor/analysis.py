"""Pure functions over sampled series: percentiles, summary `Stats`, a window's mean, the GPU saw-tooth and memory
growth.

Kept free of threads and I/O so each can be tested from a table of plain lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Stats:
    """One metric over a run. Percentiles rather than only the mean: a GPU at 50 % mean utilisation can be
    steady at 50 % (compute-bound on a small model) or alternating 0 % / 100 % (input-bound)."""

    mean: float
    p5: float
    p95: float
    minimum: float
    maximum: float
    last: float
    n: int

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values: need at least one")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be between 0 and 100 (a percentage), got {q!r}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def stats(values: Sequence[float]) -> Stats:
    """Mean, 5th/95th percentile, extremes, last value and count of a non-empty series."""
    if not values:
        raise ValueError("stats of no values: need at least one")
    return Stats(mean=math.fsum(values) / len(values), p5=percentile(values, 5), p95=percentile(values, 95),
                 minimum=min(values), maximum=max(values), last=values[-1], n=len(values))


def window_mean(times: Sequence[float], values: Sequence[float], since: float, until: float) -> float | None:
    """Mean of the values sampled from `since` to `until` (inclusive, the same clock as `times`); None if none.

    Used on GPU utilisation over the doctor's measured steps: samples taken during start-up (data set indexing,
    compilation) show an idle GPU that says nothing about the training step."""
    if len(times) != len(values):
        raise ValueError(f"times and values must have the same length, got {len(times)} and {len(values)}")
    inside = [v for t, v in zip(times, values, strict=True) if since <= t <= until]
    return math.fsum(inside) / len(inside) if inside else None


def detect_sawtooth(values: Sequence[float], low: float = 30.0, high: float = 70.0, min_cycles: int = 3,
                    min_share: float = 0.1) -> bool:
    """True when GPU utilisation (%) swings between idle and busy: the sign of an input-bound run.

    The GPU drains each batch faster than the loader makes the next, so utilisation alternates between
    ~0 % (waiting) and ~95 % (computing). Counted with hysteresis: a value must drop below `low` to
    count as idle and rise above `high` to count as busy, so noise around one threshold is not a cycle.
    True needs at least `min_cycles` idle -> busy -> idle cycles and at least `min_share` of the samples
    on each side, so a steady-busy run with a few dips (checkpoints, validation) is not flagged.

    NVML averages utilisation over 1/6-1 s, so stalls much shorter than the sampling interval blur into a
    steady middle value and are not seen here; the loader's data-wait fraction catches those.
    """
    if not low < high:
        raise ValueError(f"low must be below high, got low={low!r}, high={high!r}")
    if min_cycles < 1:
        raise ValueError(f"min_cycles must be >= 1, got {min_cycles!r}")
    if not 0.0 < min_share <= 0.5:
        raise ValueError(f"min_share must be in (0, 0.5] (a fraction of the samples), got {min_share!r}")
    if not values:
        return False
    below = sum(1 for v in values if v < low)
    above = sum(1 for v in values if v > high)
    if below < min_share * len(values) or above < min_share * len(values):
        return False
    # Collapse the series to its idle/busy phases ("L", "H"), ignoring values between the thresholds.
    phases: list[str] = []
    for v in values:
        phase = "L" if v < low else "H" if v > high else None
        if phase is not None and (not phases or phases[-1] != phase):
            phases.append(phase)
    # Phases alternate, so every busy phase with an idle phase on both sides is one L -> H -> L cycle.
    cycles = sum(1 for i in range(1, len(phases) - 1) if phases[i] == "H")
    return cycles >= min_cycles


def growth_per_minute(times: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of `values` against `times` (seconds), per minute; 0.0 with fewer than 2 points.

    Used on the workers' private memory: copy-on-read (refcount writes touching a Python list of file names shared
    by forked workers) shows as steady growth, one page per touched object, rather than as a high level.
    """
    if len(times) != len(values):
        raise ValueError(f"times and values must have the same length, got {len(times)} and {len(values)}")
    n = len(times)
    if n < 2:
        return 0.0
    mean_t = math.fsum(times) / n
    mean_v = math.fsum(values) / n
    spread = math.fsum((t - mean_t) ** 2 for t in times)
    if spread == 0.0:  # all samples at one instant: no slope to measure
        return 0.0
    slope = math.fsum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True)) / spread
    return slope * 60.0


def sustained_growth_per_minute(times: Sequence[float], values: Sequence[float], counts: Sequence[float], *,
                                since: float, started: Sequence[float] | None = None, min_points: int = 6,
                                min_span_s: float = 5.0, min_relative: float = 0.05) -> float | None:
    """Growth of the loader workers' memory (bytes per minute) that is real, not start-up; None if too short to tell.

    Meant for `workers.private_bytes`, what copy-on-read grows (RSS does not grow with it: see PsutilSource).
    Only samples taken after `since` (workers up and warm: the end of the doctor's warm-up) and in the last
    stretch of the same workers count: a steady, non-zero worker count (`counts`) and, when given, no worker
    started (`started`, cumulative: `workers.started`) inside it. Workers starting at an epoch boundary add their
    whole memory to the sum, which a fit over the run reads as growth, and non-persistent workers replaced
    between two samples leave the count as it was. Trailing samples with no worker (the workers shut down as the
    run stopped) are left out. The growth must be sustained and large against where it started
    (`min_relative`), else 0.0: a cache warming up grows once and stops; copy-on-read keeps going. The figure is
    the slower of the stretch's two halves' rates, so that a one-off step, which raises one half only, is not
    taken for a rate.
    """
    if not len(times) == len(values) == len(counts):
        raise ValueError(f"times, values and counts must have the same length, got {len(times)}, {len(values)} "
                         f"and {len(counts)}")
    if started is not None and len(started) != len(times):
        raise ValueError(f"started must have the same length as times, got {len(started)} and {len(times)}")
    generations = started if started is not None else [0.0] * len(times)
    points = [(t, v, (c, g)) for t, v, c, g in zip(times, values, counts, generations, strict=True) if t >= since]
    while points and points[-1][2][0] <= 0:
        points.pop()
    if not points:
        return None
    steady = points[-1][2]
    stretch: list[tuple[float, float]] = []
    for t, v, workers in reversed(points):
        if workers != steady:
            break
        stretch.append((t, v))
    stretch.reverse()
    if len(stretch) < min_points or stretch[-1][0] - stretch[0][0] < min_span_s:
        return None
    ts, vs = [t for t, _ in stretch], [v for _, v in stretch]
    half = len(stretch) // 2
    rates = growth_per_minute(ts[:half], vs[:half]), growth_per_minute(ts[half:], vs[half:])
    if min(rates) <= 0:
        return 0.0
    if vs[0] <= 0 or (vs[-1] - vs[0]) / vs[0] < min_relative:
        return 0.0
    return min(rates)
