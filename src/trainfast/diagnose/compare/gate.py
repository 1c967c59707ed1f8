"""Two reports compared (`compare`): each change with its interval, the notes on what else differs; and the regression
gate on the comparison (`judge`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from trainfast.decide import decide
from trainfast.diagnose.compare.figures import (
    CONTENTION_CORES,
    CONTENTION_SHARE,
    OUTSIDE_TRAINING,
    PARTS,
    RESAMPLES,
    SEED,
    STEP,
    WHOLE_RUN,
    WINDOW,
    Change,
    Comparison,
    IncomparableError,
    Ratios,
    Slowdown,
)
from trainfast.diagnose.compare.units import (
    _cost,
    _gpu_names,
    _interval,
    _kind,
    _per_step,
    _percent_interval,
    _resample,
    _Resampled,
    _Units,
    _whole_run_units,
    _window_units,
    check_comparable,
    env_of,
    pooled,
    run_factors,
)

Report = Mapping[str, Any]


def compare(base: Report | Sequence[Report], new: Report | Sequence[Report], *,
            names: tuple[str, str] = ("BASE", "NEW"), run_names: tuple[Sequence[str], Sequence[str]] | None = None,
            resamples: int = RESAMPLES, seed: int = SEED, paired: bool = False, looks: int = 1,
            versions: bool = False) -> Comparison:
    """NEW against BASE, each a doctor report's JSON or several reports of the same script (module doc). Raises
    IncomparableError naming why reports cannot be compared. `names`: how messages and notes call the two sides;
    `run_names`: each report's name (its path, say), for messages about one of them. `paired`: BASE's run i and
    NEW's run i were measured side by side (interleaved, `--runs`); `looks`: how often a sequential rule looked at
    them; `versions`: BASE and NEW are two versions of a script (checked for the same model and data, not the same
    file)."""
    runs = (_as_runs(base), _as_runs(new))
    labels = run_names or _side_labels(names, runs)
    for side, side_labels in zip(runs, labels, strict=True):
        for report, label in zip(side[1:], side_labels[1:], strict=True):
            check_comparable(side[0], report, (side_labels[0], label))
    check_comparable(runs[0][0], runs[1][0], (labels[0][0], labels[1][0]), versions=versions)
    whole = _kind(runs[0][0]) == WHOLE_RUN
    def side_units(side: list[Report], side_labels: Sequence[str]) -> list[_Units]:
        return [_whole_run_units(r["whole_run"], label) if whole else _window_units(r, label)
                for r, label in zip(side, side_labels, strict=True)]
    units = (side_units(runs[0], labels[0]), side_units(runs[1], labels[1]))
    resampled = _resample(pooled(units[0]), pooled(units[1]), resamples=resamples, seed=seed)
    factors = _run_factors(units, resampled, resamples=resamples, seed=seed)
    if resampled is None or factors is None:
        raise IncomparableError(f"too few of the {'throughput intervals' if whole else 'steps'} counted samples to "
                                "tell a change from the noise: samples/s cannot be compared")
    draw = _Draw(factors, np.random.default_rng(seed + 1))
    if whole:
        costs = [[_reported(r["whole_run"].get("seconds_per_sample"), label, "whole_run.seconds_per_sample")
                  for r, label in zip(side, side_labels, strict=True)] for side, side_labels in zip(runs, labels,
                                                                                                    strict=True)]
        # only training has a spread: the rest of the wall time is one figure per run (module doc)
        shares = [[_train_share(r["whole_run"]) for r in side] for side in runs]
        ratios = draw.ratios(costs, shares)
        cost = [statistics.fmean(c) for c in costs]
        measure = Change("wall time per sample", "s/sample", cost[0], cost[1], _interval(ratios))
        means = [_mean_whole([r["whole_run"] for r in side]) for side in runs]
        phases = _phases(*means)
        start = next((c for c in phases if c.name == "startup"), None)  # its shares of each run's wall time
        startup = ((cost[0] * (start.base_share or 0.0), cost[1] * (start.new_share or 0.0)) if start
                   else (0.0, 0.0))
        same_start = draw.ratios(costs, shares, shift=startup[0] - startup[1])
        without_startup = Slowdown("with BASE's start-up", ((cost[1] + startup[0] - startup[1]) / cost[0] - 1) * 100,
                                   *_percent_interval(same_start))
        train_costs = [[1 / _train_rate(r, u) for r, u in zip(side, side_units, strict=True)]
                       for side, side_units in zip(runs, units, strict=True)]
        train_ratios = draw.ratios(train_costs, [[1.0] * len(c) for c in train_costs])
        train = [1 / statistics.fmean(c) for c in train_costs]
        rates = [Change("train samples/s", "samples/s", train[0], train[1], _interval(1 / train_ratios))]
        goodput = Change("goodput", "share", means[0].get("goodput"), means[1].get("goodput"))
    else:
        costs = [[1 / (_number(r.get("samples_per_s")) or 1 / _cost(u)) for r, u in zip(side, side_units, strict=True)]
                 for side, side_units in zip(runs, units, strict=True)]
        ratios = draw.ratios(costs, [[1.0] * len(c) for c in costs])
        cost = [statistics.fmean(c) for c in costs]
        measure = Change("samples/s", "samples/s", 1 / cost[0], 1 / cost[1], _interval(1 / ratios))
        rates, phases, goodput, without_startup, startup = [], [], None, None, None
    what = "wall time per sample" if whole else "samples/s"
    within = Slowdown(what, (cost[1] / cost[0] - 1) * 100, *_percent_interval(ratios))
    speeds = (tuple(1 / c for c in costs[0]), tuple(1 / c for c in costs[1]))
    # the interval the gate judges: the runs' own spread between them, and the prior's where they have none
    d = decide(speeds[0], speeds[1], paired=paired and len(speeds[0]) == len(speeds[1]), looks=looks)
    slowdown = Slowdown(what, (1 / d.ratio - 1) * 100, (1 / d.high - 1) * 100, (1 / d.low - 1) * 100)
    measure = replace(measure, interval_pct=(slowdown.low_pct, slowdown.high_pct) if whole else
                      ((d.low - 1) * 100, (d.high - 1) * 100))
    sides = (pooled(units[0]), pooled(units[1]))
    parts = [_part_change(part, sides, resampled) for part in (STEP, *(p for p, _, key in PARTS if key or not whole))]
    parts = [c for c in parts if c.name == STEP or c.base or c.new]  # a part neither run has (transfer on a CPU)
    return Comparison(kind=WHOLE_RUN if whole else WINDOW, measure=measure, slowdown=slowdown, rates=rates,
                      parts=parts, phases=phases, goodput=goodput, units=(len(sides[0]), len(sides[1])),
                      notes=notes(runs[0], runs[1], names, labels),
                      contended=(_side_contention(runs[0], labels[0]), _side_contention(runs[1], labels[1])),
                      without_startup=without_startup, startup=startup, runs=(len(runs[0]), len(runs[1])),
                      run_spread_pct=(draw.spread_pct(costs[0]), draw.spread_pct(costs[1])),
                      comparable=comparability(runs[0], runs[1], labels, versions=versions), speeds=speeds,
                      paired=paired, looks=looks, within=within)


def _as_runs(side: Report | Sequence[Report]) -> list[Report]:
    """One report, or several as a list of them (anything else is one report, which `check_report` refuses)."""
    if isinstance(side, (list, tuple)) and side and all(isinstance(r, Mapping) for r in side):
        return list(side)
    if isinstance(side, (list, tuple)) and not side:
        raise IncomparableError("no report given for one side: give at least one 'trainfast doctor --json' report")
    return [side]  # type: ignore[list-item]


def _side_labels(names: tuple[str, str], runs: tuple[list[Report], list[Report]]
                 ) -> tuple[Sequence[str], Sequence[str]]:
    """Each run's name: the side's, or "BASE run 2" with several."""
    def labels(name: str, count: int) -> list[str]:
        return [name] if count == 1 else [f"{name} run {i + 1}" for i in range(count)]
    return labels(names[0], len(runs[0])), labels(names[1], len(runs[1]))


def _run_factors(units: tuple[list[_Units], list[_Units]], resampled: _Resampled | None, *, resamples: int,
                 seed: int) -> tuple[list[Ratios], list[Ratios]] | None:
    """Each run's seconds per sample in each resample of its own units, over its own (around 1): one run a side
    keeps the pair's joint resampling (`_resample`); several, each run its own."""
    if resampled is None:
        return None
    if len(units[0]) == len(units[1]) == 1:
        return [resampled.base_cost], [resampled.new_cost]
    rng = np.random.default_rng(seed)
    found = tuple([run_factors(u, resamples=resamples, rng=rng) for u in side] for side in units)
    if any(f is None for side in found for f in side):
        return None
    return found  # type: ignore[return-value]


@dataclass
class _Draw:
    """Each resample's seconds per sample of a side (`side`): one run's reported figure with the share of it that
    training takes moved by its resampled units; several runs: as many drawn with replacement, each moved by its own
    resampled units, their deviations from the side's mean widened by sqrt(n / (n - 1)) (drawing n of n runs
    understates their spread by (n - 1) / n), averaged. The spread between runs enters the interval so: three runs
    of the same script on a machine that swings 22 % now and then give an interval that holds the swing."""

    factors: tuple[list[Ratios], list[Ratios]]
    rng: np.random.Generator

    def side(self, which: int, costs: Sequence[float], shares: Sequence[float]) -> Ratios:
        per_run = np.array([c * (1 - s + s * f) for c, s, f in zip(costs, shares, self.factors[which], strict=True)])
        n = len(costs)
        if n == 1:
            return np.asarray(per_run[0], dtype=np.float64)
        mean = per_run.mean(axis=0)
        widened = mean + (per_run - mean) * math.sqrt(n / (n - 1))
        picks = self.rng.integers(0, n, size=(n, per_run.shape[1]))
        return np.asarray(np.take_along_axis(widened, picks, axis=0).mean(axis=0), dtype=np.float64)

    def ratios(self, costs: Sequence[Sequence[float]], shares: Sequence[Sequence[float]], *,
               shift: float = 0.0) -> Ratios:
        """NEW's seconds per sample over BASE's in each resample; `shift` added to NEW's (BASE's start-up in place
        of NEW's)."""
        return np.asarray((self.side(1, costs[1], shares[1]) + shift) / self.side(0, costs[0], shares[0]),
                          dtype=np.float64)

    @staticmethod
    def spread_pct(costs: Sequence[float]) -> float | None:
        """The runs' spread: their standard deviation over their mean, in %; None for one run."""
        return statistics.stdev(costs) / statistics.fmean(costs) * 100 if len(costs) > 1 else None


def _mean_whole(wholes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several runs' whole_run entries as one: each phase's seconds and share, and goodput, averaged."""
    if len(wholes) == 1:
        return dict(wholes[0])
    tables = [{str(p.get("phase")): p for p in w.get("phases") or [] if isinstance(p, Mapping)} for w in wholes]
    order = list(dict.fromkeys(name for t in tables for name in t))

    def mean(name: str, key: str) -> float | None:
        values = [_number(t[name].get(key)) for t in tables if name in t]
        known = [v for v in values if v is not None]
        return statistics.fmean(known) if known else None
    goodputs = [g for w in wholes if (g := _number(w.get("goodput"))) is not None]
    return {"phases": [{"phase": name, "seconds": mean(name, "seconds"), "share": mean(name, "share")}
                       for name in order],
            "goodput": statistics.fmean(goodputs) if goodputs else None}


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


def notes(base: Report | Sequence[Report], new: Report | Sequence[Report], names: tuple[str, str] = ("BASE", "NEW"),
          labels: tuple[Sequence[str], Sequence[str]] | None = None) -> list[str]:
    """What the reports record of a difference between the runs that is not the script's (module doc)."""
    runs = (_as_runs(base), _as_runs(new))
    labels = labels or _side_labels(names, runs)
    each = [(r, label) for side, side_labels in zip(runs, labels, strict=True)
            for r, label in zip(side, side_labels, strict=True)]
    out = []
    for report, name in each:
        busy = contention(report)
        if busy:
            out.append(f"{name} was measured while {busy}: its figures include that contention")
    torch_versions = [env_of(runs[0][0]).get("torch"), env_of(runs[1][0]).get("torch")]
    if None not in torch_versions and torch_versions[0] != torch_versions[1]:
        out.append(f"torch differs: {torch_versions[0]} in {names[0]}, {torch_versions[1]} in {names[1]}: the change "
                   "may be torch's, not the script's")
    for report, name in each:
        whole = report.get("whole_run")
        if not isinstance(whole, Mapping):
            continue
        goodput = _number(whole.get("goodput"))
        if goodput is not None and goodput < OUTSIDE_TRAINING:
            out.append(f"{name} spent {1 - goodput:.0%} of its wall time outside training ({_largest_phases(whole)}):"
                       " one figure per run, with no spread in the interval, which holds training's noise alone")
    signals = [runs[0][0].get("step_signal"), runs[1][0].get("step_signal")]
    if None not in signals and signals[0] != signals[1]:
        out.append(f"a step is not the same in both: the {signals[0]} step in {names[0]}, the {signals[1]} step in "
                   f"{names[1]}: compare samples/s, not the seconds per step")
    return out


def comparability(base: Sequence[Report], new: Sequence[Report], labels: tuple[Sequence[str], Sequence[str]], *,
                  versions: bool = False) -> list[str]:
    """What makes the runs comparable, one line each: the machine, torch, the shape (checked by
    `check_comparable`: reports that differ there do not get this far) and other processes' CPU use."""
    env = env_of(base[0])
    gpus = ", ".join(_gpu_names(env.get("gpus")) or []) or "no GPU"
    cpus = env.get("usable_cpus")
    machine = ", ".join(str(x) for x in (env.get("cpu"), f"{cpus} usable CPUs" if cpus else None, gpus) if x)
    torch_versions = sorted({str(env_of(r).get("torch")) for r in (*base, *new)})
    busy = [f"{label} ({why})" for side, side_labels in ((base, labels[0]), (new, labels[1]))
            for r, label in zip(side, side_labels, strict=True) if (why := contention(r))]
    count = len(base) + len(new)
    return [f"machine: the same in all {count} runs ({machine})",
            f"torch: {torch_versions[0]}" if len(torch_versions) == 1 else
            f"torch: differs ({', '.join(torch_versions)}): the change may be torch's",
            "shape: two versions of the script with the same arguments, batch sizes, data, FLOPs a step and world "
            "size" if versions else "shape: the same script, arguments, batch sizes and world size",
            "other processes: " + (f"busy in {', '.join(busy)}" if busy else
                                   f"quiet in all {count} runs (under {CONTENTION_CORES:g} core busy)")]


def _side_contention(side: Sequence[Report], labels: Sequence[str]) -> str | None:
    """"other processes kept 1.4 of 2 cores busy" for a side with one run, "NEW run 2: ..." with several; None when
    no run of the side was contended."""
    found = [(label, why) for r, label in zip(side, labels, strict=True) if (why := contention(r))]
    if not found:
        return None
    if len(side) == 1:
        return found[0][1]
    return "; ".join(f"{label}: {why}" for label, why in found)


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
