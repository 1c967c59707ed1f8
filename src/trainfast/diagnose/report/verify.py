"""`trainfast doctor --verify`: measure each fix instead of estimating it.

A fix with `overrides` can be injected into the unmodified script (capture/inject.py `apply_overrides`: DataLoader
arguments, intra-op threads, cudnn.benchmark, TF32, the script's autocast off); the rules say which fixes have them
(fixes/rule.py `Rule.injects`). `verify_report` is the library function `run_doctor(verify=True)` and the CLI call:
the report with its injectable fixes measured, ranked by what they measured, and the record of the runs.

`verify_fixes` re-runs the script once per fix, each in a fresh process (`python -m trainfast.diagnose.run.child
SPEC.json`, which runs the doctor inside `apply_overrides`), between two runs of the unchanged script: base, fix 1,
..., fix N, base (ABA), so drift over the runs shows. A fix's measured gain is its samples/s over the mean of the
two baselines of the same repeat; over several repeats, the
median. Every child gets the same environment, working directory and interpreter: the overrides, passed
in the spec file, are the only difference between a fix's run and the baseline. Before the first child, the parent
hands back what it can of the device memory its own run left (the children need it).

Not under torchrun: every rank would start its own children, each inheriting the rank's RANK, WORLD_SIZE,
MASTER_ADDR/MASTER_PORT and torchrun's agent store, and joining or clashing with the job's rendezvous. Stripping
those would not help a DDP script, which needs them to start at all; single-process with RANK=0 WORLD_SIZE=1 and
MASTER_* set by hand, each child hosts its own process group, one after the other.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainfast.diagnose.capture.inject import check_overrides, merge_overrides
from trainfast.diagnose.capture.stop import launched_ranks
from trainfast.diagnose.fixes.rule import rank
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.report.verify_runs import child_env, run_child
from trainfast.loader.auto import batches_in_flight
from trainfast.decide import FASTER

log = logging.getLogger("trainfast.diagnose")


# A child pays the Python + torch import and the report on top of the doctor's own --max-seconds.
STARTUP_MARGIN_S = 60.0


BASELINE = "baseline"


def torchrun_refusal(target: str, *, module: bool, env: Mapping[str, str] | None = None) -> str | None:
    """Why `--verify` cannot run in this process (a rank of a torchrun job: module doc), or None when it can."""
    env = os.environ if env is None else env
    if not launched_ranks(env):
        return None
    seen = ", ".join(f"{key}={env[key]}" for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID") if key in env)
    command = f"trainfast doctor --verify {'-m ' if module else ''}{target}"
    return (f"--verify cannot run under torchrun ({seen}): it re-runs the script once per fix, each in a fresh "
            "single process, and here every rank would start its own, each inheriting RANK, WORLD_SIZE, "
            "MASTER_ADDR/MASTER_PORT and torchrun's store, which would join or clash with this job's rendezvous. "
            f"Run `{command}` without torchrun (a script that starts a process group from the environment runs "
            "alone with RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 set), or this torchrun command "
            "without --verify")


def _free_device_memory() -> None:
    """Hand back what the parent's measured run left on the device: its script has unwound, but CUDA's caching
    allocator keeps the freed blocks reserved, memory a child's run of the same script needs. Without CUDA
    initialised, nothing is asked (asking would create a context)."""
    gc.collect()  # the script's tensors still in reference cycles (a model and its hooks, an exception's frames)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _fmt_overrides(overrides: Mapping[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (overrides or {}).items())


def _record(label: str, overrides: dict[str, Any] | None, say: Callable[[str], None], runs: list[dict[str, Any]],
            total: int, *, spec: dict[str, Any], **child: Any) -> dict[str, Any]:
    """One child run (`_run_child`), warmed up past its own workers' batches in flight, said before and after,
    appended to `runs`."""
    n = len(runs) + 1
    what = "baseline (the script unchanged)" if overrides is None else f"{label} ({_fmt_overrides(overrides)})"
    say(f"verify {n}/{total}: {what} ...")
    spec = spec | {"warmup": steady_warmup(spec["warmup"], overrides)}
    run = run_child(label, overrides, name=f"run{n:03d}", spec=spec, **child) | {"warmup": spec["warmup"]}
    runs.append(run)
    if run["error"]:
        say(f"verify {n}/{total}: {label} failed after {run['seconds']:.1f} s: {run['error']}")
    else:
        say(f"verify {n}/{total}: {label}: {run['samples_per_s']:,.1f} samples/s in {run['seconds']:.1f} s")
    return run


def _gain(values: list[float], error: str | None = None) -> dict[str, Any]:
    return {"median": statistics.median(values) if values else None, "min": min(values, default=None),
            "max": max(values, default=None), "measured_repeats": len(values), "error": None if values else error}


def verify_fixes(target: str, *, module: bool = False, args: Sequence[str] | None = None,
                 recommendations: Sequence[Recommendation], steps: int = 30, warmup: int = 5,
                 max_seconds: float | None = 300.0, repeats: int = 1, whole_run: bool = False,
                 progress: Callable[[str], None] | None = None,
                 startup_margin_s: float = STARTUP_MARGIN_S) -> tuple[list[Recommendation], dict[str, Any]]:
    """Re-run `target` per fix with `overrides` (fresh processes, ABA with a baseline), then the set of fixes
    verified faster applied at once (`SET`, each repeat followed by one more baseline); return the recommendations
    with `measured_gain` filled and ranked (fixes/rule.py `rank`), and the record for `Report.verify`. `whole_run`:
    each child runs the script to its end, and a run's figure is its samples over its whole wall time."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give 1 or more")
    refusal = torchrun_refusal(target, module=module)
    if refusal is not None:
        raise RuntimeError(refusal)
    say = progress or (lambda line: None)
    started = time.perf_counter()
    fixes: list[tuple[Recommendation, dict[str, Any]]] = []
    runs: list[dict[str, Any]] = []
    invalid: dict[str, str] = {}
    for r in recommendations:
        if r.overrides:
            try:
                fixes.append((r, check_overrides(r.overrides)))
            except ValueError as e:
                invalid[r.id] = str(e)
    info: dict[str, Any] = {"runs": runs, "baseline_samples_per_s": [], "gains": {}, "seconds": 0.0,
                            "repeats": repeats, "steps": steps, "warmup": warmup, "baseline_drift": [],
                            "whole_run": whole_run, "set": None}
    gains: dict[str, dict[str, Any]] = {r.id: _gain([], invalid.get(r.id)) for r in recommendations if r.overrides}
    info["gains"] = gains
    if not fixes:
        info["note"] = "no fix could be injected into the script: nothing was re-run"
        return rank(recommendations), info

    plan: list[tuple[str, dict[str, Any] | None]] = [(BASELINE, None), *((r.id, o) for r, o in fixes),
                                                     (BASELINE, None)]
    total = len(plan) * repeats
    spec = {"target": target, "module": module, "args": list(args or []), "steps": steps, "warmup": warmup,
            "max_seconds": max_seconds, "whole_run": whole_run}
    timeout_s = None if max_seconds is None else max_seconds + startup_margin_s
    ratios: dict[str, list[float]] = {r.id: [] for r, _ in fixes}
    errors: dict[str, str] = {}
    _free_device_memory()
    with tempfile.TemporaryDirectory(prefix="trainfast-verify-") as tmp:
        child: dict[str, Any] = {"spec": spec, "workdir": Path(tmp), "env": child_env(), "cwd": os.getcwd(),
                                 "timeout_s": timeout_s}
        for repeat in range(repeats):
            this_repeat = [_record(label, overrides, say, runs, total, **child) | {"repeat": repeat}
                           for label, overrides in plan]
            runs[-len(plan):] = this_repeat
            bases = [r for r in this_repeat if r["fix"] == BASELINE]
            info["baseline_samples_per_s"].extend(r["samples_per_s"] for r in bases)
            good = [r["samples_per_s"] for r in bases if not r["error"]]
            if len(good) == 2:
                info["baseline_drift"].append(good[1] / good[0])
            for run in this_repeat:
                if run["fix"] == BASELINE:
                    continue
                if not good:
                    errors.setdefault(run["fix"], "no baseline run measured anything")
                elif run["error"]:
                    errors.setdefault(run["fix"], run["error"])
                else:
                    ratios[run["fix"]].append(run["samples_per_s"] / statistics.fmean(good))
        measured: dict[str, float] = {}
        for fix_id, values in ratios.items():
            gains[fix_id] = _gain(values, gains[fix_id]["error"] or errors.get(fix_id))
            if values:
                measured[fix_id] = statistics.median(values)
        info["set"] = _verify_set([(r, o) for r, o in fixes if measured.get(r.id, 0.0) >= FASTER], gains,
                                  runs, repeats, say, **child)
    info["seconds"] = time.perf_counter() - started
    verified = [replace(r, measured_gain=measured[r.id], gain_basis="verified", basis_reason=None)
                if r.overrides and r.id in measured else r for r in recommendations]
    return rank(verified), info


SET = "set"


def steady_warmup(warmup: int, overrides: Mapping[str, Any] | None) -> int:
    """A run's warm-up: at least the batches its loader workers hold in flight (workers x prefetch_factor, 2 by
    default). Those fill during the warm-up; measured while they drain, more workers on reads that wait timed 35x the
    script's speed over 8 steps where their steady rate was a tenth of that. Only the runs with such workers wait for
    them: a baseline warmed up past 26 workers' 52 batches of 20 ms reads took 26 s where its fix took 7 s."""
    overrides = overrides or {}
    return max(warmup, batches_in_flight(int(overrides.get("num_workers") or 0), overrides.get("prefetch_factor")))


def _verify_set(members: list[tuple[Recommendation, dict[str, Any]]], gains: Mapping[str, Mapping[str, Any]],
                runs: list[dict[str, Any]], repeats: int, say: Callable[[str], None],
                **child: Any) -> dict[str, Any] | None:
    """The fixes verified faster alone, applied at once (the set a user would apply), each repeat followed by one
    more baseline: its gain over the baselines on either side. A member "vanishes" in the set where the set is not
    `FASTER` than the best of the others alone (more workers taking the cores threads had; a layout that changes
    what bf16 gains)."""
    if not members:
        return None
    measured = {fix_id: gain["median"] for fix_id, gain in gains.items() if gain["median"] is not None}
    members = sorted(members, key=lambda m: -measured[m[0].id])  # the rank of what they measured: first wins
    ids = [r.id for r, _ in members]
    merged, dropped = merge_overrides([(r.id, o) for r, o in members])
    entry: dict[str, Any] = {"ids": ids, "overrides": merged, "dropped": dropped, "vanished": [], "runs": [],
                             **_gain([])}
    if len(members) == 1:  # its own runs are the set's
        entry.update({k: gains[ids[0]][k] for k in ("median", "min", "max", "measured_repeats", "error")},
                     note=f"one fix verified faster alone: the set is {ids[0]}")
        return entry
    say(f"verify: the {len(ids)} fixes verified faster, at once: {', '.join(ids)}"
        + (f" ({'; '.join(dropped)})" if dropped else ""))
    total = len(runs) + 2 * repeats
    values: list[float] = []
    error = None
    for repeat in range(repeats):
        before = next((r for r in reversed(runs) if r["fix"] == BASELINE), None)
        applied = _record(SET, merged, say, runs, total, **child) | {"repeat": repeat}
        after = _record(BASELINE, None, say, runs, total, **child) | {"repeat": repeat}
        runs[-2:] = [applied, after]
        entry["runs"].append(len(runs) - 2)
        bases = [r["samples_per_s"] for r in (before, after) if r is not None and not r["error"]]
        if applied["error"] or not bases:
            error = error or applied["error"] or "no baseline run measured anything"
        else:
            values.append(applied["samples_per_s"] / statistics.fmean(bases))
    entry.update(_gain(values, error))
    if entry["median"] is not None:
        entry["vanished"] = [fix for fix in ids if entry["median"] < FASTER * max(
            measured[other] for other in ids if other != fix)]
    return entry


def set_line(entry: Mapping[str, Any]) -> str:
    """The set's result in a line (the terminal's and the progress's)."""
    ids = " + ".join(entry["ids"])
    if entry.get("note"):
        return f"together: {entry['note']}"
    if entry["median"] is None:
        return f"together ({ids}): not measured: {entry['error'] or 'no result'}"
    spread = (f" ({entry['min']:.2f}-{entry['max']:.2f}x over {entry['measured_repeats']} repeats)"
              if entry["measured_repeats"] > 1 else "")
    line = f"together ({ids}): {entry['median']:.2f}x{spread}"
    if entry["vanished"]:
        line += (f"; {', '.join(entry['vanished'])} gained nothing in the set (it is not {FASTER:g}x faster than the "
                 "best of the others alone)")
    return line


def verify_report(report: Report, target: str, *, module: bool = False, args: Sequence[str] | None = None,
                  steps: int = 30, warmup: int = 5, max_seconds: float | None = 300.0, repeats: int = 1,
                  progress: Callable[[str], None] | None = None) -> Report:
    """`report` with its injectable fixes measured (`verify_fixes`; a whole run's report: each run to its end, its
    wall time compared): ranked by what they measured, the record of the runs in `verify`. What it does and how it
    goes is said through `progress` (one line at a time); interrupted
    (Ctrl-C, which also ends the child running), the report comes back unverified, its gains the estimated ones."""
    say = progress or (lambda line: None)
    fixes = [r for r in report.recommendations if r.overrides]
    if not fixes:
        say("verify: no fix to re-run: " + ("none of the fixes can be injected into the script without editing it"
                                            if report.recommendations else "the doctor recommended none"))
    else:
        runs = (len(fixes) + 2) * repeats
        limit = "to its end" if max_seconds is None else f"up to {max_seconds:g} s"
        say(f"verify: {runs} more run(s) of the script, each in a fresh process and {limit}: "
            f"baseline, {', '.join(r.id for r in fixes)}, baseline" + (f"; x{repeats}" if repeats > 1 else "")
            + f"; then, where 2 or more measure {FASTER:g}x or faster, those at once and a baseline"
            + (" (each time)" if repeats > 1 else ""))
    try:
        ranked, info = verify_fixes(target, module=module, args=args, recommendations=report.recommendations,
                                    steps=steps, warmup=warmup, max_seconds=max_seconds, repeats=repeats,
                                    whole_run=report.whole_run is not None, progress=say)
    except KeyboardInterrupt:  # the child was killed; the report still has the first run's estimates
        say("verify: interrupted; the report shows the estimated gains only")
        return report
    baselines = [f"{v:,.1f}" if v is not None else "failed" for v in info["baseline_samples_per_s"]]
    if baselines:
        drift = ", ".join(f"{d - 1:+.0%}" for d in info["baseline_drift"]) or "n/a"
        say(f"verify: baseline {' / '.join(baselines)} samples/s (drift after/before: {drift}); "
            f"{len(info['runs'])} run(s) in {info['seconds']:.0f} s")
    for fix_id, gain in info["gains"].items():
        if gain["median"] is None:
            say(f"verify: {fix_id} not measured: {gain['error'] or 'no result'}")
    if info["set"] is not None:
        say(f"verify: {set_line(info['set'])}")
    return replace(report, recommendations=rank(ranked, by_run=report.whole_run is not None), verify=info)
