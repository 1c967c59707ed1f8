"""Two reports compared (`compare`): each change with its interval, the notes on what else differs; and the regression
gate on the comparison (`judge`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainfast.diagnose.compare.figures import (
    CONTENTION_CORES,
    CONTENTION_SHARE,
    OUTSIDE_TRAINING,
    PARTS,
    RESAMPLES,
    SEED,
    STARTUP_NOISE,
    STEP,
    WHOLE_RUN,
    WINDOW,
    Change,
    Comparison,
    Gate,
    IncomparableError,
    Ratios,
    Slowdown,
)
from trainfast.diagnose.compare.units import (
    _cost,
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
)


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
