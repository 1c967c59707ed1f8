"""What a comparison finds: each change with its interval (`Change`), the slowdown the gate judges (`Slowdown`), the
comparison (`Comparison`) and the gate's decision (`Gate`), and the thresholds they use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from trainfast.decide import Decision, decide

MIN_UNITS = 10  # measured steps (window) or throughput intervals after the first (whole run) per report


RESAMPLES = 2000


CONFIDENCE = 0.95  # the parts' and phases' intervals (within the runs); the gate's is the decision's (trainfast.decide)


SEED = 0


RESAMPLE_CELLS = 2_000_000  # resamples x units drawn at once (16 MB of counts), however many units a report has


# A run measured while other processes kept this many cores busy (the doctor's own note), and at least this share
# of the machine's cores (half a core of daemons is nothing on 64), was slowed by them
CONTENTION_CORES = 0.5


CONTENTION_SHARE = 0.1


# A whole run whose training is less than this share of its wall time gets a note: the rest has no interval
OUTSIDE_TRAINING = 0.5


# A whole run's start-up is one figure per run. A slowdown that rests on it fails the gate only when it grew by more
# than this: the same script's start-up took 2.4-3.5 s over 15 runs on a shared 2-vCPU VM, within ±20 % of its median
STARTUP_NOISE = 0.25


REQUIRED = ("samples_per_s", "timeline", "script", "loaders", "world_size")


# a step's parts: (name shown, timeline row key, throughput interval key or None)
PARTS = (("data wait", "wait_s", "data_wait_s"), ("transfer", "transfer_s", "transfer_s"),
         ("host", "host_s", "host_s"), ("collection", "collect_s", None), ("compute", "compute_s", "compute_s"))


STEP = "step"  # the whole step's seconds, beside its parts


Ratios = NDArray[np.float64]


WINDOW, WHOLE_RUN = "window", "whole_run"


class IncomparableError(ValueError):
    """Two reports that cannot be compared; the message names why in one line."""


@dataclass(frozen=True)
class Change:
    """One figure in BASE and NEW. `interval_pct`: the 95 % interval of the % change, None where the figure has
    no spread to take one from (phases, goodput) or BASE's is 0."""

    name: str
    unit: str  # "samples/s", "s/sample", "s/step", "s" or "share"
    base: float | None
    new: float | None
    interval_pct: tuple[float, float] | None = None
    base_share: float | None = None  # a phase's share of the wall time
    new_share: float | None = None

    @property
    def ratio(self) -> float | None:
        """NEW over BASE; None without both or with BASE 0."""
        if self.base is None or self.new is None or self.base == 0:
            return None
        return self.new / self.base

    @property
    def change_pct(self) -> float | None:
        ratio = self.ratio
        return None if ratio is None else (ratio - 1) * 100

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "unit": self.unit, "base": self.base, "new": self.new,
                               "ratio": self.ratio, "change_pct": self.change_pct,
                               "interval_pct": list(self.interval_pct) if self.interval_pct else None}
        if self.base_share is not None or self.new_share is not None:
            out |= {"base_share": self.base_share, "new_share": self.new_share}
        return out


@dataclass(frozen=True)
class Slowdown:
    """NEW's time per sample over BASE's, less 1, in %: positive slower, negative faster; with its interval."""

    measure: str  # "samples/s" (window) or "wall time per sample" (whole run)
    pct: float
    low_pct: float
    high_pct: float

    @property
    def noise_pct(self) -> float:
        """The interval's half-width: how far the runs' own spread leaves the change uncertain."""
        return (self.high_pct - self.low_pct) / 2

    def to_json(self) -> dict[str, Any]:
        return {"measure": self.measure, "pct": self.pct, "interval_pct": [self.low_pct, self.high_pct],
                "noise_pct": self.noise_pct}


@dataclass(frozen=True)
class Comparison:
    kind: str  # WINDOW or WHOLE_RUN
    measure: Change  # samples/s (window) or wall time per sample (whole run)
    slowdown: Slowdown
    rates: list[Change]  # a whole run's training samples/s; empty for a window (its measure is samples/s)
    parts: list[Change]  # seconds per step: the step, then each part
    phases: list[Change] = field(default_factory=list)  # whole runs
    goodput: Change | None = None  # whole runs
    units: tuple[int, int] = (0, 0)  # steps (window) or throughput intervals (whole run) behind the intervals
    notes: list[str] = field(default_factory=list)
    # BASE's and NEW's contention (`contention`): other processes slowed that run, what the gate may not judge on
    contended: tuple[str | None, str | None] = (None, None)
    # whole runs: the slowdown had NEW started up as fast as BASE (per sample), and each run's start-up per sample
    without_startup: Slowdown | None = None
    startup: tuple[float, float] | None = None
    runs: tuple[int, int] = (1, 1)  # reports a side
    run_spread_pct: tuple[float | None, float | None] = (None, None)  # each side's runs' sd over their mean, in %
    comparable: list[str] = field(default_factory=list)  # what makes the runs comparable, a line each
    # each run's speed (samples/s; a whole run's samples per wall second), per side: what the gate decides on
    speeds: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    paired: bool = False  # the runs were measured in interleaved pairs (--runs): BASE i beside NEW i
    looks: int = 1  # how many times a sequential --runs looked at its growing runs (trainfast.decide)
    within: Slowdown | None = None  # the slowdown from the runs' own steps alone: no between-run spread in it

    def decision(self, threshold: float) -> Decision:
        """NEW against BASE at `threshold` (a ratio: 1.05 for --fail-slower 5), by the one decision."""
        paired = self.paired and len(self.speeds[0]) == len(self.speeds[1])
        return decide(self.speeds[0], self.speeds[1], threshold=threshold, paired=paired, looks=self.looks)

    @property
    def rows(self) -> list[Change]:
        """Every figure, in the order shown."""
        return [self.measure, *self.rates, *self.parts, *self.phases, *([self.goodput] if self.goodput else [])]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "measure": self.measure.to_json(), "slowdown": self.slowdown.to_json(),
                "slowdown_without_startup": self.without_startup.to_json() if self.without_startup else None,
                "startup_s_per_sample": list(self.startup) if self.startup else None,
                "rates": [c.to_json() for c in self.rates], "parts": [c.to_json() for c in self.parts],
                "phases": [c.to_json() for c in self.phases],
                "goodput": self.goodput.to_json() if self.goodput else None,
                "units": {"base": self.units[0], "new": self.units[1],
                          "of": "steps" if self.kind == WINDOW else "throughput intervals"},
                "runs": {"base": self.runs[0], "new": self.runs[1]},
                "run_spread_pct": {"base": self.run_spread_pct[0], "new": self.run_spread_pct[1]},
                "comparable": list(self.comparable),
                "confidence": CONFIDENCE, "resamples": RESAMPLES, "notes": list(self.notes),
                "speeds": {"base": list(self.speeds[0]), "new": list(self.speeds[1])}, "paired": self.paired,
                "looks": self.looks, "slowdown_within_runs": self.within.to_json() if self.within else None,
                "contended": {"base": self.contended[0], "new": self.contended[1]}}


# the exit codes: not slower, slower, reports that cannot be compared (cli), cannot tell
PASS, SLOWER, INCOMPARABLE, INCONCLUSIVE = 0, 1, 2, 3
INCONCLUSIVE_CHOICES = ("exit", "pass", "fail")  # --inconclusive: exit 3, or 0, or 1


@dataclass(frozen=True)
class Gate:
    """The regression gate's verdict (`judge`): `verdict` is the one line to print."""

    fail_slower_pct: float | None
    decided: bool  # False: the runs cannot tell (noise, contention, start-up): `inconclusive` says what it exits
    failed: bool
    verdict: str
    decision: Decision | None = None
    inconclusive: str = "exit"  # INCONCLUSIVE_CHOICES

    @property
    def exit_code(self) -> int:
        if self.failed:
            return SLOWER
        if self.decided:
            return PASS
        return {"exit": INCONCLUSIVE, "pass": PASS, "fail": SLOWER}[self.inconclusive]

    def to_json(self) -> dict[str, Any]:
        return {"fail_slower_pct": self.fail_slower_pct, "decided": self.decided, "failed": self.failed,
                "exit_code": self.exit_code, "verdict": self.verdict, "inconclusive": self.inconclusive,
                "decision": self.decision.to_json() if self.decision else None}
