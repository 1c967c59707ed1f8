"""`trainfast doctor --verify`: measure each fix instead of estimating it.

A fix with `overrides` can be injected into the unmodified script (capture/inject.py `apply_overrides`: DataLoader
arguments, intra-op threads, cudnn.benchmark, TF32, the script's autocast off); the rules say which fixes have them
(fixes/rule.py `Rule.injects`). `verify_report` is the library function `run_doctor(verify=True)` and the CLI call:
the report with its injectable fixes measured, ranked by what they measured, and the record of the runs.

`verify_fixes` re-runs the script once per fix, each in a fresh process (`python -m trainfast.diagnose.run.child
SPEC.json`, which runs the doctor inside `apply_overrides`), between two runs of the unchanged script: base, fix 1,
..., fix N, base (ABA), so drift over the runs shows. A fix's measured gain is its samples/s over the mean of the
two baselines of the same repeat; over several repeats, the median. Whether it is faster is decided
(report/verify_gains.py, with decide.py's `decide`: one pair a repeat, the two baselines the spread of a setting
against itself), and whether it trains the same (its loss against the baselines', records/losses.py): a fix is kept,
for the set and for `trainfast run --apply`, only when decided faster and not known to train differently. Every
child gets the same environment, working directory and interpreter: the overrides, passed in the spec file, are the
only difference between a fix's run and the baseline. Before the first child, the parent
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

from trainfast.decide import FASTER, decide
from trainfast.diagnose.capture.inject import check_overrides, merge_overrides
from trainfast.diagnose.capture.stop import launched_ranks
from trainfast.diagnose.fixes.rule import rank
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.report.verify_gains import (
    BASELINE,
    Pair,
    gain_entry,
    gain_line,
    kept,
    loss_check,
    trains_entry,
)
from trainfast.diagnose.report.verify_runs import child_env, run_child
from trainfast.loader.auto import batches_in_flight

log = logging.getLogger("trainfast.diagnose")


# A child pays the Python + torch import and the report on top of the doctor's own --max-seconds.
STARTUP_MARGIN_S = 60.0

# The loss keys of a fix that never ran (its overrides are not valid): nothing to compare
NOT_RUN: dict[str, Any] = {"trains_same": None, "trains_differently": None, "loss": None}


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
        loss = f" (loss {run['loss']:.4g})" if run.get("loss") is not None else ""
        say(f"verify {n}/{total}: {label}: {run['samples_per_s']:,.1f} samples/s in {run['seconds']:.1f} s{loss}")
    return run


def verify_fixes(target: str, *, module: bool = False, args: Sequence[str] | None = None,
                 recommendations: Sequence[Recommendation], steps: int = 30, warmup: int = 5,
                 max_seconds: float | None = 300.0, repeats: int = 1, whole_run: bool = False,
                 progress: Callable[[str], None] | None = None,
                 startup_margin_s: float = STARTUP_MARGIN_S) -> tuple[list[Recommendation], dict[str, Any]]:
    """Re-run `target` per fix with `overrides` (fresh processes, ABA with a baseline), each decided faster or not and
    its loss compared with the baselines' (verify_gains.py), then the set of fixes kept (decided faster, training the
    same) applied at once (`SET`, each repeat followed by one more baseline); return the recommendations with
    `measured_gain` filled and ranked (fixes/rule.py `rank`), and the record for `Report.verify`. `whole_run`: each
    child runs the script to its end, a run's figure is its samples over its whole wall time and its loss its last
    steps'."""
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
    gains: dict[str, dict[str, Any]] = {r.id: gain_entry([], [], invalid.get(r.id)) | NOT_RUN
                                        for r in recommendations if r.overrides}
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
    pairs: dict[str, list[Pair]] = {r.id: [] for r, _ in fixes}
    nulls: list[Pair] = []  # each repeat's (baseline before, baseline after): the setting against itself
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
                nulls.append((good[0], good[1]))
            for run in this_repeat:
                if run["fix"] == BASELINE:
                    continue
                if not good:
                    errors.setdefault(run["fix"], "no baseline run measured anything")
                elif run["error"]:
                    errors.setdefault(run["fix"], run["error"])
                else:
                    pairs[run["fix"]].append((statistics.fmean(good), run["samples_per_s"]))
        base_runs = [run for run in runs if run["fix"] == BASELINE]
        for r, _ in fixes:
            gains[r.id] = gain_entry(pairs[r.id], nulls, gains[r.id]["error"] or errors.get(r.id)) | trains_entry(
                loss_check([run for run in runs if run["fix"] == r.id], base_runs), r.changes_training)
        for fix_id, gain in gains.items():
            say(f"verify: {gain_line(fix_id, gain)}")
        info["set"] = _verify_set([(r, o) for r, o in fixes if kept(gains[r.id])], gains, runs, repeats, say,
                                  nulls=nulls, alone=pairs, **child)
        if info["set"] is not None:
            say(f"verify: {set_line(info['set'])}")
    info["seconds"] = time.perf_counter() - started
    measured = {fix_id: gain["median"] for fix_id, gain in gains.items() if gain["median"] is not None}
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
                runs: list[dict[str, Any]], repeats: int, say: Callable[[str], None], *, nulls: Sequence[Pair],
                alone: Mapping[str, Sequence[Pair]], **child: Any) -> dict[str, Any] | None:
    """The fixes kept alone (verify_gains.py `kept`: decided faster, training the same), applied at once (the set a
    user would apply), each repeat followed by one more baseline: its decision against the baselines on either side
    (their pairs, and the fixes' baselines, as `null_pairs`). A member "vanished" in the set where the set's gains are
    decided no faster (by `FASTER`) than the best of the others' alone (more workers taking the cores threads had; a
    layout that changes what bf16 gains); "undecided" where that cannot be told either way (two repeats of runs that
    differ ~8 % tell a 1.03x difference from none only rarely: decide.py's `RUN_NOISE`)."""
    if not members:
        return None
    measured = {fix_id: gain["median"] for fix_id, gain in gains.items() if gain["median"] is not None}
    members = sorted(members, key=lambda m: -measured[m[0].id])  # the rank of what they measured: first wins
    ids = [r.id for r, _ in members]
    merged, dropped = merge_overrides([(r.id, o) for r, o in members])
    entry: dict[str, Any] = {"ids": ids, "overrides": merged, "dropped": dropped, "vanished": [], "undecided": [],
                             "runs": [], **gain_entry([], nulls)}
    if len(members) == 1:  # its own runs are the set's
        entry.update(gains[ids[0]], note=f"one fix kept alone: the set is {ids[0]}")
        return entry
    say(f"verify: the {len(ids)} fixes kept alone, at once: {', '.join(ids)}"
        + (f" ({'; '.join(dropped)})" if dropped else ""))
    total = len(runs) + 2 * repeats
    pairs: list[Pair] = []
    set_nulls = list(nulls)
    error = None
    for repeat in range(repeats):
        before = next((r for r in reversed(runs) if r["fix"] == BASELINE), None)
        applied = _record(SET, merged, say, runs, total, **child) | {"repeat": repeat}
        after = _record(BASELINE, None, say, runs, total, **child) | {"repeat": repeat}
        runs[-2:] = [applied, after]
        entry["runs"].append(len(runs) - 2)
        bases = [r["samples_per_s"] for r in (before, after) if r is not None and not r["error"]]
        if len(bases) == 2:
            set_nulls.append((bases[0], bases[1]))
        if applied["error"] or not bases:
            error = error or applied["error"] or "no baseline run measured anything"
        else:
            pairs.append((statistics.fmean(bases), applied["samples_per_s"]))
    entry.update(gain_entry(pairs, set_nulls, error) | trains_entry(loss_check(
        [runs[i] for i in entry["runs"]], [run for run in runs if run["fix"] == BASELINE]), None))
    if pairs:
        together = [b / a for a, b in pairs]
        for fix in ids:
            best = max((other for other in ids if other != fix), key=lambda other: measured[other])
            adds = decide([b / a for a, b in alone[best]], together, paired=False)
            if adds.no_gain:
                entry["vanished"].append(fix)
            elif not adds.faster:
                entry["undecided"].append(fix)
    return entry


def set_line(entry: Mapping[str, Any]) -> str:
    """The set's result in a line (the terminal's and the progress's)."""
    ids = " + ".join(entry["ids"])
    if entry.get("note"):
        return f"together: {entry['note']}"
    if entry.get("decision") is None:
        return f"together ({ids}): not measured: {entry['error'] or 'no result'}"
    line = f"together: {gain_line(ids, entry)}"
    if entry["vanished"]:
        line += (f"; {', '.join(entry['vanished'])} gained nothing in the set (it is decided no {FASTER:g}x faster "
                 "than the best of the others alone)")
    if entry.get("undecided"):
        line += (f"; cannot tell what {', '.join(entry['undecided'])} adds to the others in the set (more repeats "
                 "would tell)")
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
            + f"; then, where 2 or more are decided faster (by {FASTER:g}x, beyond the runs' noise) and train the "
            "same, those at once and a baseline"
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
    return replace(report, recommendations=rank(ranked, by_run=report.whole_run is not None), verify=info)
