"""The units of noise a report's figures are resampled over (a window's measured steps, a whole run's throughput
intervals), the checks that two reports can be compared, and the resampling itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainfast.diagnose.compare.figures import (
    CONFIDENCE,
    MIN_UNITS,
    PARTS,
    REQUIRED,
    RESAMPLE_CELLS,
    RESAMPLES,
    SEED,
    STEP,
    WHOLE_RUN,
    WINDOW,
    IncomparableError,
    Ratios,
)


@dataclass(frozen=True)
class _Units:
    """A report's units of noise as columns: samples, seconds, steps and each part's seconds."""

    samples: list[float]
    seconds: list[float]
    steps: list[float]
    parts: dict[str, list[float]]  # part name -> seconds per unit (STEP included)

    def __len__(self) -> int:
        return len(self.seconds)


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
    code = report["script"].get("exit_code")
    if code:  # a crash's speed is not the script's: never a decision on it
        error = str(report["script"].get("error") or report["script"].get("outcome") or "").strip().splitlines()
        raise IncomparableError(f"{name}'s script crashed (exit code {code}{': ' + error[-1] if error else ''}): a "
                                "run that crashed is not compared; fix it, or rerun it, and compare again")


def check_comparable(base: Mapping[str, Any], new: Mapping[str, Any], names: tuple[str, str] = ("BASE", "NEW"), *,
                     versions: bool = False) -> None:
    """Raise IncomparableError, naming why, unless the two reports measured the same thing the same way. `versions`:
    two versions of a script (`compare --runs OLD NEW`), which differ by design: the same arguments, data (each
    loader's dataset and batches an epoch) and FLOPs a step (the model's shape) instead of the same file."""
    b, n = names
    check_report(base, b)
    check_report(new, n)
    kinds = [_kind(base), _kind(new)]
    if kinds[0] != kinds[1]:
        which = {WINDOW: "a window report (trainfast doctor)", WHOLE_RUN: "a whole-run report (doctor --whole-run)"}
        raise IncomparableError(f"{b} is {which[kinds[0]]} and {n} is {which[kinds[1]]}: compare two reports of the "
                                "same kind")
    scripts = [(r["script"].get("target"), list(r["script"].get("args") or [])) for r in (base, new)]
    if versions:
        _check_versions(base, new, names)
        scripts = [("", args) for _, args in scripts]
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
    envs = [env_of(base), env_of(new)]
    for key, what in (("cpu", "CPUs"), ("usable_cpus", "usable CPU counts"), ("gpus", "GPUs")):
        values = [_gpu_names(e.get(key)) if key == "gpus" else e.get(key) for e in envs]
        if None not in values and values[0] != values[1]:
            raise IncomparableError(f"different machines: the {what} differ ({values[0]} in {b}, {values[1]} in {n}); "
                                    "compare runs measured on the same machine (a CI gate: the same runner type)")


def _check_versions(base: Mapping[str, Any], new: Mapping[str, Any], names: tuple[str, str]) -> None:
    """Two versions of a script train the same model on the same data: each loader's dataset (its class) and batches
    an epoch, and the FLOPs of a step within 1 % (a model of another shape counts other FLOPs; precision, layout and
    compile do not change them)."""
    b, n = names
    data = [[(loader.get("dataset"), loader.get("batches_per_epoch")) for loader in r["loaders"]
             if isinstance(loader, Mapping)] for r in (base, new)]
    if data[0] != data[1]:
        raise IncomparableError(f"different data: the loaders' (dataset, batches an epoch) are {data[0]} in {b} and "
                                f"{data[1]} in {n}; two versions of a script compare only on the same data")
    flops = [_number_of((r.get("compute") or {}).get("flops_per_step")) for r in (base, new)]
    if flops[0] and flops[1] and abs(flops[1] / flops[0] - 1) > 0.01:
        raise IncomparableError(f"different model: a step counts {flops[0]:.3g} FLOPs in {b} and {flops[1]:.3g} in "
                                f"{n}; two versions of a script compare only with the same model shape")


def _number_of(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def env_of(report: Mapping[str, Any]) -> Mapping[str, Any]:
    """A report's `env`, or an empty one where it has none."""
    env = report.get("env")
    return env if isinstance(env, Mapping) else {}


def _gpu_names(gpus: Any) -> list[str] | None:
    if not isinstance(gpus, list):
        return None
    return [str(g.get("name")) if isinstance(g, Mapping) else str(g) for g in gpus]


def _kind(report: Mapping[str, Any]) -> str:
    return WINDOW if report.get("whole_run") is None else WHOLE_RUN


def _script(target: Any, args: list[Any]) -> str:
    return f"{target}" + (f" with arguments {args}" if args else " with no arguments")


def _batch_sizes(report: Mapping[str, Any]) -> list[Any]:
    return [loader.get("batch_size") if isinstance(loader, Mapping) else None for loader in report["loaders"]]


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


@dataclass(frozen=True)
class _Resampled:
    """Both reports' units resampled (module doc): each run's seconds per sample in each resample over its units'
    own (`base_cost`, `new_cost`: around 1), and each part's seconds per step, NEW over BASE (None where BASE's
    came to 0 in some resample: no ratio to take)."""

    base_cost: Ratios
    new_cost: Ratios
    parts: dict[str, Ratios | None]


def _sums(units: _Units, parts: list[str], resamples: int, rng: np.random.Generator) -> Ratios:
    """Each resample's column sums (resamples x [samples, seconds, steps, *parts]): each resample as how many times
    it drew each unit."""
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


def run_factors(units: _Units, *, resamples: int, rng: np.random.Generator) -> Ratios | None:
    """One run's seconds per sample in each resample of its units over its units' own (around 1); None when some
    resample drew no samples."""
    sums = _sums(units, [], resamples, rng)
    if not np.all(sums[:, 0] > 0):
        return None
    return np.asarray(sums[:, 1] / sums[:, 0] / _cost(units), dtype=np.float64)


def pooled(runs: list[_Units]) -> _Units:
    """Several runs' units as one run's (a side's parts of the step, over all its runs' steps)."""
    if len(runs) == 1:
        return runs[0]
    return _Units(samples=[x for u in runs for x in u.samples], seconds=[x for u in runs for x in u.seconds],
                  steps=[x for u in runs for x in u.steps],
                  parts={p: [x for u in runs for x in u.parts[p]] for p in runs[0].parts})


def _resample(base: _Units, new: _Units, *, resamples: int = RESAMPLES, seed: int = SEED) -> _Resampled | None:
    """None when some resample drew no samples at all (too few units hold samples)."""
    rng = np.random.default_rng(seed)
    parts = list(base.parts)
    b, n = _sums(base, parts, resamples, rng), _sums(new, parts, resamples, rng)
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
