"""Two doctor reports side by side (`trainfast compare BASE NEW`), and the regression gate on them (pure functions).

What is compared. A window report (`trainfast doctor`): samples/s, and each part of the step in seconds per step
(the mean over the `timeline` rows of `wait_s`, `transfer_s`, `host_s`, `collect_s`, `compute_s`, and of
`total_s`). A whole-run report (`whole_run` not null): wall time per sample (`whole_run.seconds_per_sample`), the
training phase's samples/s, each part of a training step from the `throughput` intervals, each phase's seconds and
share, and goodput.

The units of noise. A window report's units are its measured steps (`timeline` rows); a whole run's are its
`throughput` intervals (consecutive steps, over their own training time), all but the first, which holds the
warm-up and any compilation. A report needs `MIN_UNITS` of them: fewer cannot show how much its speed varies.

The interval of a change. Each report's units are resampled with replacement (`RESAMPLES` times, seeded, so the
same two reports always give the same intervals), independently for BASE and NEW. In each resample a run's
seconds per sample is its reported figure (1 / samples/s over the measured window; a whole run's wall time per
sample) with the share of it that training takes (all of a window; a whole run's goodput) moved by the resample:
times the resampled units' seconds per sample (their seconds summed over their samples summed) over all units'.
A whole run's time outside training (startup, compile, evaluation, checkpoints, ...) is one figure per run, with
no spread to resample, and stays as measured; a note says when it is most of the run. Each part's seconds per
step is its sum over the steps' sum in the resampled units. The 2.5th and 97.5th percentiles of NEW's figure over
BASE's across the resamples are the 95 % interval of the change. Phases and goodput are shown without one.

The gate (`judge`). "% slower" is NEW's time per sample over BASE's, less 1 (15 % slower: each sample takes 1.15x
as long, samples/s x 1/1.15); the measure is samples/s for a window report and the wall time per sample for a whole
run. With `fail_slower` PCT:
- fail (exit 1) when the slowdown's lower bound, the interval's edge closest to no change, is above PCT %: slower by
  more than PCT beyond the noise;
- cannot decide (exit 0, with a warning) when the interval reaches above PCT % but not its lower bound, and either
  its half-width (the noise) is larger than PCT, so these two runs cannot tell a PCT % slowdown from none, or it
  reaches past 2 x PCT, so it cannot rule out a slowdown of twice the allowance. Measuring more steps (or on a
  quieter machine) narrows it. Passing is the choice here: a gate that failed on noise would fail runs of the same
  script; the warning says the gate did not judge;
- cannot decide either, for whole runs, when the slowdown's lower bound is above PCT but, with BASE's start-up
  (NEW's start-up time per sample taken as BASE's), it would not be, and the start-up grew by at most
  `STARTUP_NOISE`: a start-up is one figure per run, with no spread to tell a change from the machine's
  run-to-run noise (the interpreter and the imports read from disk). Beyond `STARTUP_NOISE` it fails (a start-up
  60 s longer is a slower run);
- cannot decide either when a run the verdict rests on was slowed by other processes (the report's
  `contention`: at least `CONTENTION_CORES` cores busy, and `CONTENTION_SHARE` of the machine's): a failure whose
  NEW was contended (the slowdown may be theirs), a pass whose BASE was (a slowed yardstick hides a slowdown);
- pass (exit 0) otherwise.
So a pass says the interval stays below PCT, or below 2 x PCT with a noise of at most PCT: at `--fail-slower 5`
a real 15 % slowdown passes only when it measured 5 % plus its noise (2 standard errors) below the truth, with
that noise at most 5 % (for normal noise, at worst 1 in 20,000); otherwise it fails, or the gate says it cannot
decide. Two runs of the same script fail only when their measured gap exceeds PCT beyond the noise of both, with
NEW uncontended.

The interval covers the noise within each run, step to step. A shift between the two runs as a whole is not noise
the steps can show: other processes' CPU use is judged above; the notes name what else the reports record (a
different torch, CPU count or GPU, a script that failed), and PCT is the allowance for the rest.

Reports that cannot be compared raise `IncomparableError` naming why: not a doctor report, a different script or
arguments, a different shape (loaders' batch sizes, world size), a whole run against a window, no or too few
measured steps, no samples counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

MIN_UNITS = 10  # measured steps (window) or throughput intervals after the first (whole run) per report
RESAMPLES = 2000
CONFIDENCE = 0.95
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
WINDOW, WHOLE_RUN = "window", "whole_run"
# a step's parts: (name shown, timeline row key, throughput interval key or None)
PARTS = (("data wait", "wait_s", "data_wait_s"), ("transfer", "transfer_s", "transfer_s"),
         ("host", "host_s", "host_s"), ("collection", "collect_s", None), ("compute", "compute_s", "compute_s"))
STEP = "step"  # the whole step's seconds, beside its parts


Ratios = NDArray[np.float64]


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
                "confidence": CONFIDENCE, "resamples": RESAMPLES, "notes": list(self.notes),
                "contended": {"base": self.contended[0], "new": self.contended[1]}}


@dataclass(frozen=True)
class Gate:
    """The regression gate's verdict (`judge`): `verdict` is the one line to print."""

    fail_slower_pct: float | None
    decided: bool  # False: the noise is wider than the threshold and the gate could not judge
    failed: bool
    verdict: str

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {"fail_slower_pct": self.fail_slower_pct, "decided": self.decided, "failed": self.failed,
                "exit_code": self.exit_code, "verdict": self.verdict}


@dataclass(frozen=True)
class _Units:
    """A report's units of noise as columns: samples, seconds, steps and each part's seconds."""

    samples: list[float]
    seconds: list[float]
    steps: list[float]
    parts: dict[str, list[float]]  # part name -> seconds per unit (STEP included)

    def __len__(self) -> int:
        return len(self.seconds)


# ------------------------------------------------------------------------------------------------ checks


def check_report(report: Any, name: str) -> None:
    """Raise IncomparableError unless `report` looks like a doctor report's JSON."""
    if not isinstance(report, Mapping):
        raise IncomparableError(f"{name} is not a trainfast doctor report (a JSON {type(report).__name__}, not an "
                                "object); write one with: trainfast doctor --json PATH script.py")
    missing = [k for k in REQUIRED if k not in report]
    if missing:
        raise IncomparableError(f"{name} is not a trainfast doctor report: it has no {', '.join(map(repr, missing))};"
                                " write one with: trainfast doctor --json PATH script.py")
    for key, kind in (("timeline", list), ("script", Mapping), ("loaders", list)):
        if not isinstance(report[key], kind):
            raise IncomparableError(f"{name} is not a trainfast doctor report: its {key!r} is not a "
                                    f"{'list' if kind is list else 'mapping'}")
    whole = report.get("whole_run")
    if whole is not None and not isinstance(whole, Mapping):
        raise IncomparableError(f"{name} is not a trainfast doctor report: its 'whole_run' is not an object")


def check_comparable(base: Mapping[str, Any], new: Mapping[str, Any], names: tuple[str, str] = ("BASE", "NEW")
                     ) -> None:
    """Raise IncomparableError, naming why, unless the two reports measured the same thing the same way."""
    b, n = names
    check_report(base, b)
    check_report(new, n)
    kinds = [_kind(base), _kind(new)]
    if kinds[0] != kinds[1]:
        which = {WINDOW: "a window report (trainfast doctor)", WHOLE_RUN: "a whole-run report (doctor --whole-run)"}
        raise IncomparableError(f"{b} is {which[kinds[0]]} and {n} is {which[kinds[1]]}: compare two reports of the "
                                "same kind")
    scripts = [(r["script"].get("target"), list(r["script"].get("args") or [])) for r in (base, new)]
    if scripts[0] != scripts[1]:
        raise IncomparableError(f"different scripts: {b} ran {_script(*scripts[0])}, {n} ran {_script(*scripts[1])}; "
                                "compare two reports of the same script and arguments")
    if base["world_size"] != new["world_size"]:
        raise IncomparableError(f"different shape: {b} ran on {base['world_size']} rank(s), {n} on "
                                f"{new['world_size']}; compare runs with the same world size")
    sizes = [_batch_sizes(r) for r in (base, new)]
    if sizes[0] != sizes[1]:
        raise IncomparableError(f"different shape: the loaders' batch sizes are {sizes[0]} in {b} and {sizes[1]} in "
                                f"{n}; compare runs with the same batch sizes")


def _kind(report: Mapping[str, Any]) -> str:
    return WINDOW if report.get("whole_run") is None else WHOLE_RUN


def _script(target: Any, args: list[Any]) -> str:
    return f"{target}" + (f" with arguments {args}" if args else " with no arguments")


def _batch_sizes(report: Mapping[str, Any]) -> list[Any]:
    return [loader.get("batch_size") if isinstance(loader, Mapping) else None for loader in report["loaders"]]


# ------------------------------------------------------------------------------------------------ units


def _window_units(report: Mapping[str, Any], name: str) -> _Units:
    rows = [r for r in report["timeline"] if isinstance(r, Mapping)]
    if not rows:
        outcome = report["script"].get("outcome")
        raise IncomparableError(f"{name} has no measured steps" + (f" ({outcome})" if outcome else "")
                                + ": nothing to compare; rerun trainfast doctor until it measures steps")
    try:
        parts = {STEP: [float(r["total_s"]) for r in rows]}
        for part, key, _ in PARTS:
            parts[part] = [float(r.get(key) or 0.0) for r in rows]
        units = _Units(samples=[float(r.get("samples") or 0) for r in rows], seconds=parts[STEP],
                       steps=[1.0] * len(rows), parts=parts)
    except (KeyError, TypeError, ValueError) as e:
        raise IncomparableError(f"{name} is not a trainfast doctor report: a 'timeline' row is malformed ({e!r})"
                                ) from None
    return _enough(units, name, "measured steps", "rerun trainfast doctor with more --steps (30 or more)")


def _whole_run_units(whole: Mapping[str, Any], name: str) -> _Units:
    intervals = [t for t in (whole.get("throughput") or [])[1:] if isinstance(t, Mapping)]
    samples: list[float] = []
    seconds: list[float] = []
    steps: list[float] = []
    parts: dict[str, list[float]] = {part: [] for part in (STEP, *(p for p, _, key in PARTS if key))}
    try:
        for t in intervals:
            count, n = float(t.get("samples") or 0), float(t.get("steps") or 0)
            rate = t.get("samples_per_s")
            if not count or not n or not rate:
                continue
            samples.append(count)
            seconds.append(count / float(rate))
            steps.append(n)
            parts[STEP].append(count / float(rate))
            for part, _, key in PARTS:
                if key:
                    parts[part].append(float(t.get(key) or 0.0) * n)  # the intervals hold seconds per step
    except (TypeError, ValueError) as e:
        raise IncomparableError(f"{name} is not a trainfast doctor report: a 'whole_run.throughput' interval is "
                                f"malformed ({e!r})") from None
    units = _Units(samples=samples, seconds=seconds, steps=steps, parts=parts)
    return _enough(units, name, "throughput intervals with samples after the first",
                   "rerun trainfast doctor --whole-run on a run of more steps")


def _enough(units: _Units, name: str, what: str, fix: str) -> _Units:
    if len(units) < MIN_UNITS:
        raise IncomparableError(f"{name} has {len(units)} {what}; at least {MIN_UNITS} are needed to tell a change "
                                f"from the noise: {fix}")
    if sum(units.samples) <= 0:
        raise IncomparableError(f"{name} counted no samples in its steps (the batches' size could not be read): "
                                "samples/s cannot be compared")
    return units


# ------------------------------------------------------------------------------------------------ resampling


@dataclass(frozen=True)
class _Resampled:
    """Both reports' units resampled (module doc): each run's seconds per sample in each resample over its units'
    own (`base_cost`, `new_cost`: around 1), and each part's seconds per step, NEW over BASE (None where BASE's
    came to 0 in some resample: no ratio to take)."""

    base_cost: Ratios
    new_cost: Ratios
    parts: dict[str, Ratios | None]


def _resample(base: _Units, new: _Units, *, resamples: int = RESAMPLES, seed: int = SEED) -> _Resampled | None:
    """None when some resample drew no samples at all (too few units hold samples)."""
    rng = np.random.default_rng(seed)
    parts = list(base.parts)

    def sums(units: _Units) -> Ratios:
        """Each resample's column sums (resamples x [samples, seconds, steps, *parts]): each resample as how
        many times it drew each unit."""
        matrix = np.array([units.samples, units.seconds, units.steps, *(units.parts[p] for p in parts)],
                          dtype=np.float64).T
        count = len(units)
        chunk = max(1, RESAMPLE_CELLS // count)
        out = []
        for start in range(0, resamples, chunk):
            rows = min(chunk, resamples - start)
            drawn = rng.integers(0, count, size=(rows, count)) + count * np.arange(rows)[:, None]
            out.append(np.bincount(drawn.ravel(), minlength=rows * count).reshape(rows, count) @ matrix)
        return np.concatenate(out)

    b, n = sums(base), sums(new)
    if not (np.all(b[:, 0] > 0) and np.all(n[:, 0] > 0)):
        return None
    ratios: dict[str, Ratios | None] = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        for column, part in enumerate(parts, start=3):
            ratio = (n[:, column] / n[:, 2]) / (b[:, column] / b[:, 2])
            ratios[part] = ratio if bool(np.all(np.isfinite(ratio))) else None
    return _Resampled(base_cost=b[:, 1] / b[:, 0] / _cost(base), new_cost=n[:, 1] / n[:, 0] / _cost(new),
                      parts=ratios)


def _interval(ratios: Ratios | None) -> tuple[float, float] | None:
    """The `CONFIDENCE` interval of the % change from resampled ratios (None: no interval)."""
    return None if ratios is None else _percent_interval(ratios)


def _percent_interval(ratios: Ratios) -> tuple[float, float]:
    ordered = np.sort(ratios)
    tail = (1 - CONFIDENCE) / 2
    low, high = ordered[int(tail * (len(ordered) - 1))], ordered[int((1 - tail) * (len(ordered) - 1))]
    return float((low - 1) * 100), float((high - 1) * 100)


def _cost(units: _Units) -> float:
    return sum(units.seconds) / sum(units.samples)


def _per_step(units: _Units, part: str) -> float:
    return sum(units.parts[part]) / sum(units.steps)


# ------------------------------------------------------------------------------------------------ comparison


def compare(base: Mapping[str, Any], new: Mapping[str, Any], *, names: tuple[str, str] = ("BASE", "NEW"),
            resamples: int = RESAMPLES, seed: int = SEED) -> Comparison:
    """NEW against BASE, each a doctor report's JSON (module doc). Raises IncomparableError naming why two
    reports cannot be compared. `names`: how messages and notes call the two (the paths, say)."""
    check_comparable(base, new, names)
    whole = _kind(base) == WHOLE_RUN
    if whole:
        units = (_whole_run_units(base["whole_run"], names[0]), _whole_run_units(new["whole_run"], names[1]))
    else:
        units = (_window_units(base, names[0]), _window_units(new, names[1]))
    resampled = _resample(*units, resamples=resamples, seed=seed)
    if resampled is None:
        raise IncomparableError(f"too few of the {'throughput intervals' if whole else 'steps'} counted samples to "
                                "tell a change from the noise: samples/s cannot be compared")
    if whole:
        costs = [_reported(r["whole_run"].get("seconds_per_sample"), name, "whole_run.seconds_per_sample")
                 for r, name in zip((base, new), names, strict=True)]
        # only training has a spread: the rest of the wall time is one figure per run (module doc)
        shares = [_train_share(r["whole_run"]) for r in (base, new)]
        ratios = _cost_ratios(costs, shares, resampled)
        measure = Change("wall time per sample", "s/sample", costs[0], costs[1], _interval(ratios))
        phases = _phases(base["whole_run"], new["whole_run"])
        start = next((c for c in phases if c.name == "startup"), None)  # its shares of each run's wall time
        startup = ((costs[0] * (start.base_share or 0.0), costs[1] * (start.new_share or 0.0)) if start
                   else (0.0, 0.0))
        same_start = _cost_ratios(costs, shares, resampled, shift=startup[0] - startup[1])
        without_startup = Slowdown("with BASE's start-up", ((costs[1] + startup[0] - startup[1]) / costs[0] - 1) * 100,
                                   *_percent_interval(same_start))
        train_rates = [_train_rate(r, u) for r, u in zip((base, new), units, strict=True)]
        train_ratios = _cost_ratios([1 / r for r in train_rates], [1.0, 1.0], resampled)
        rates = [Change("train samples/s", "samples/s", train_rates[0], train_rates[1], _interval(1 / train_ratios))]
        goodput = Change("goodput", "share", _number(base["whole_run"].get("goodput")),
                         _number(new["whole_run"].get("goodput")))
    else:
        reported = [_number(r.get("samples_per_s")) or 1 / _cost(u) for r, u in zip((base, new), units, strict=True)]
        costs = [1 / r for r in reported]
        ratios = _cost_ratios(costs, [1.0, 1.0], resampled)
        measure = Change("samples/s", "samples/s", reported[0], reported[1], _interval(1 / ratios))
        rates, phases, goodput, without_startup, startup = [], [], None, None, None
    low, high = _percent_interval(ratios)
    slowdown = Slowdown("wall time per sample" if whole else "samples/s", (costs[1] / costs[0] - 1) * 100, low, high)
    parts = [_part_change(part, units, resampled) for part in (STEP, *(p for p, _, key in PARTS if key or not whole))]
    parts = [c for c in parts if c.name == STEP or c.base or c.new]  # a part neither run has (transfer on a CPU)
    return Comparison(kind=WHOLE_RUN if whole else WINDOW, measure=measure, slowdown=slowdown, rates=rates,
                      parts=parts, phases=phases, goodput=goodput, units=(len(units[0]), len(units[1])),
                      notes=notes(base, new, names), contended=(contention(base), contention(new)),
                      without_startup=without_startup, startup=startup)


def _cost_ratios(costs: Sequence[float], shares: Sequence[float], resampled: _Resampled, *,
                 shift: float = 0.0) -> Ratios:
    """NEW's seconds per sample over BASE's in each resample: each run's reported `costs`, the part of it that
    training takes (`shares`) moved by that run's resampled training cost, the rest as measured; `shift` added to
    NEW's (BASE's start-up in place of NEW's)."""
    base = costs[0] * (1 - shares[0] + shares[0] * resampled.base_cost)
    new = costs[1] * (1 - shares[1] + shares[1] * resampled.new_cost) + shift
    return np.asarray(new / base, dtype=np.float64)


def _train_share(whole: Mapping[str, Any]) -> float:
    """Training's share of a whole run's wall time (its goodput); all of it when the report does not say."""
    goodput = _number(whole.get("goodput"))
    return 1.0 if goodput is None else min(1.0, max(0.0, goodput))


def _part_change(part: str, units: tuple[_Units, _Units], resampled: _Resampled) -> Change:
    base, new = _per_step(units[0], part), _per_step(units[1], part)
    return Change(part, "s/step", base, new, _interval(resampled.parts.get(part)) if base > 0 else None)


def _train_rate(report: Mapping[str, Any], units: _Units) -> float:
    train = report["whole_run"].get("train")
    rate = _number(train.get("samples_per_s")) if isinstance(train, Mapping) else None
    return rate or 1 / _cost(units)


def _phases(base: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    def table(whole: Mapping[str, Any]) -> dict[str, tuple[float | None, float | None]]:
        return {str(p.get("phase")): (_number(p.get("seconds")), _number(p.get("share")))
                for p in whole.get("phases") or [] if isinstance(p, Mapping)}

    b, n = table(base), table(new)
    order = [*b, *(p for p in n if p not in b)]
    return [Change(p, "s", b.get(p, (None, None))[0], n.get(p, (None, None))[0],
                   base_share=b.get(p, (None, None))[1], new_share=n.get(p, (None, None))[1])
            for p in order if (b.get(p, (None, None))[0] or n.get(p, (None, None))[0])]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _reported(value: Any, name: str, key: str) -> float:
    number = _number(value)
    if not number or number <= 0:
        raise IncomparableError(f"{name} has no {key} (no training samples were counted): nothing to compare")
    return number


def notes(base: Mapping[str, Any], new: Mapping[str, Any], names: tuple[str, str] = ("BASE", "NEW")) -> list[str]:
    """What the reports record of a difference between the two runs that is not the script's (module doc)."""
    out = []
    for report, name in zip((base, new), names, strict=True):
        busy = contention(report)
        if busy:
            out.append(f"{name} was measured while {busy}: its figures include that contention")
        code = report["script"].get("exit_code")
        if code:
            out.append(f"{name}'s script ended with exit code {code} ({report['script'].get('outcome') or 'failed'})")
    envs: list[Mapping[str, Any]] = [r["env"] if isinstance(r.get("env"), Mapping) else {} for r in (base, new)]
    for key, what in (("torch", "torch"), ("usable_cpus", "usable CPUs"), ("gpus", "GPUs")):
        values = [_gpu_names(e.get(key)) if key == "gpus" else e.get(key) for e in envs]
        if None not in values and values[0] != values[1]:
            out.append(f"{what} differ: {values[0]} in {names[0]}, {values[1]} in {names[1]}: the change may be "
                       "the machine's, not the script's")
    for report, name in zip((base, new), names, strict=True):
        whole = report.get("whole_run")
        if not isinstance(whole, Mapping):
            continue
        goodput = _number(whole.get("goodput"))
        if goodput is not None and goodput < OUTSIDE_TRAINING:
            out.append(f"{name} spent {1 - goodput:.0%} of its wall time outside training ({_largest_phases(whole)}):"
                       " one figure per run, with no spread in the interval, which holds training's noise alone")
    signals = [r.get("step_signal") for r in (base, new)]
    if None not in signals and signals[0] != signals[1]:
        out.append(f"a step is not the same in both: the {signals[0]} step in {names[0]}, the {signals[1]} step in "
                   f"{names[1]}: compare samples/s, not the seconds per step")
    return out


def contention(report: Mapping[str, Any]) -> str | None:
    """"other processes kept 1.4 of 2 cores busy" when they did, enough to slow the run (`CONTENTION_CORES`,
    `CONTENTION_SHARE`); None when not, or not known."""
    figures = report.get("contention")
    if not isinstance(figures, Mapping):
        return None
    busy, cores = _number(figures.get("other_cores_busy_mean")), _number(figures.get("cores"))
    if busy is None or busy < max(CONTENTION_CORES, CONTENTION_SHARE * (cores or 0)):
        return None
    return f"other processes kept {busy:.1f} of {cores:g} cores busy" if cores else \
        f"other processes kept {busy:.1f} cores busy"


def _largest_phases(whole: Mapping[str, Any]) -> str:
    """"startup 63 %, epoch start 3 %": the phases outside training, largest first, those of 1 % or more."""
    shares = sorted(((_number(p.get("share")) or 0.0, str(p.get("phase"))) for p in whole.get("phases") or []
                     if isinstance(p, Mapping) and p.get("phase") != "train"), reverse=True)
    return ", ".join(f"{phase.replace('_', ' ')} {share:.0%}" for share, phase in shares if share >= 0.01) or "—"


def _gpu_names(gpus: Any) -> list[str] | None:
    if not isinstance(gpus, list):
        return None
    return [str(g.get("name")) if isinstance(g, Mapping) else str(g) for g in gpus]


# ------------------------------------------------------------------------------------------------ the gate


def judge(comparison: Comparison, fail_slower_pct: float | None = None) -> Gate:
    """The regression gate (module doc): fail when NEW is slower than BASE by more than `fail_slower_pct` % beyond
    the noise; pass, saying it could not decide, when the noise is wider than the threshold or the verdict would
    rest on a run other processes slowed. Without a threshold, only the line saying the change."""
    s = comparison.slowdown
    change = _said(s)
    if fail_slower_pct is None:
        return Gate(None, True, False, f"{change}; no --fail-slower given → exit 0")
    limit = f"--fail-slower {fail_slower_pct:g} %"
    base_busy, new_busy = comparison.contended
    if s.low_pct > fail_slower_pct:
        if new_busy:  # the slowdown may be the other processes'
            return Gate(fail_slower_pct, False, False,
                        f"warning: cannot decide: {change}, more than {limit}, but NEW was measured while {new_busy}: "
                        "the slowdown may be theirs; rerun NEW on a quiet machine → exit 0")
        w, startup = comparison.without_startup, comparison.startup
        if w is not None and w.low_pct <= fail_slower_pct and startup is not None and \
                startup[1] <= startup[0] * (1 + STARTUP_NOISE):  # one figure a run: no spread to judge it by
            return Gate(fail_slower_pct, False, False,
                        f"warning: cannot decide: {change}, more than {limit}, but with BASE's start-up it would be "
                        f"{_signed(w)}: the difference is the start-up ({_startup_change(comparison)}), one figure "
                        f"per run, which varies by up to {STARTUP_NOISE:.0%} between runs of the same script; rerun "
                        "both → exit 0")
        return Gate(fail_slower_pct, True, True, f"{change}: more than {limit} → exit 1")
    if base_busy:  # a yardstick slowed by other processes can hide a slowdown
        return Gate(fail_slower_pct, False, False,
                    f"warning: cannot decide: {change}, but BASE was measured while {base_busy}: a slowed baseline "
                    "can hide a slowdown; remeasure BASE on a quiet machine → exit 0")
    more = "measure more steps (--steps) on a quieter machine, or raise --fail-slower → exit 0"
    if s.high_pct > fail_slower_pct and s.noise_pct > fail_slower_pct:
        return Gate(fail_slower_pct, False, False,
                    f"warning: cannot decide: {change}, and the noise (±{s.noise_pct:.1f} %) is wider than {limit}: "
                    f"these runs cannot tell a {fail_slower_pct:g} % slowdown from none; {more}")
    if s.high_pct > 2 * fail_slower_pct:
        return Gate(fail_slower_pct, False, False,
                    f"warning: cannot decide: {change}: not beyond {limit} by the noise, but a slowdown of twice "
                    f"that ({2 * fail_slower_pct:g} %) is within the interval; {more}")
    return Gate(fail_slower_pct, True, False, f"{change}: not more than {limit} beyond the noise → exit 0")


def _signed(s: Slowdown, per: str = "") -> str:
    """"6.1 % slower (interval 2.0–9.9 %)" or "1.2 % faster (slowdown interval -3.0 to +0.7 %)"."""
    interval = (f"{s.low_pct:.1f}–{s.high_pct:.1f} %" if s.low_pct >= 0
                else f"{s.low_pct:+.1f} to {s.high_pct:+.1f} %")
    return f"{s.pct:.1f} % slower{per} (interval {interval})" if s.pct >= 0 else \
        f"{-s.pct:.1f} % faster{per} (slowdown interval {interval})"


def _startup_change(comparison: Comparison) -> str:
    """"startup 2.10 → 2.61 s"."""
    phase = next((c for c in comparison.phases if c.name == "startup"), None)
    return f"startup {phase.base or 0.0:.2f} → {phase.new or 0.0:.2f} s" if phase else "startup"


def _said(s: Slowdown) -> str:
    """"NEW is 17.2 % slower (interval 14.1–20.3 %)", or "faster" (interval of the slowdown, signed)."""
    return "NEW is " + _signed(s, " in wall time per sample" if s.measure == "wall time per sample" else "")
