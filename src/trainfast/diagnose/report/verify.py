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
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainfast.atomic import as_write_failure, write_json
from trainfast.diagnose.capture.inject import LOADER_KEYS, check_overrides
from trainfast.diagnose.capture.stop import launched_ranks
from trainfast.diagnose.fixes.rule import rank
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report.report import Report

log = logging.getLogger("trainfast.diagnose")


# A child pays the Python + torch import and the report on top of the doctor's own --max-seconds.
STARTUP_MARGIN_S = 60.0


OUTPUT_TAIL_CHARS = 4000


BASELINE = "baseline"


def _child_env() -> dict[str, str]:
    """The one environment every child gets: this process's, with this trainfast importable."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # the output tail survives a kill on timeout
    package_root = str(Path(__file__).resolve().parents[2])
    if Path(package_root).name not in ("site-packages", "dist-packages"):
        paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
        if package_root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    return env


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - OUTPUT_TAIL_CHARS))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's session (it, and any loader workers it left) if anything of it is still there."""
    if hasattr(os, "killpg"):
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    elif proc.poll() is None:
        proc.kill()


def _applied(overrides: Mapping[str, Any], loaders: list[dict[str, Any]]) -> bool:
    """Did the loader overrides reach a loader the steps used? (True when there are none to check.)"""
    wanted = {k: v for k, v in overrides.items() if k in LOADER_KEYS}
    if not wanted:
        return True
    if wanted.get("num_workers", 1) == 0 or not any(loader.get("num_workers") for loader in loaders):
        wanted = {k: v for k, v in wanted.items() if k in ("num_workers", "pin_memory")}
    return any(all(loader.get(k) == v for k, v in wanted.items()) for loader in loaders)


def _run_child(label: str, overrides: Mapping[str, Any] | None, spec: dict[str, Any], *, workdir: Path, name: str,
               env: dict[str, str], cwd: str, timeout_s: float | None) -> dict[str, Any]:
    """One fresh-process doctor run; never raises for the script's or the child's failure."""
    spec_path, out, log_path = (workdir / f"{name}.spec.json", workdir / f"{name}.out.json",
                                workdir / f"{name}.log")
    run: dict[str, Any] = {"fix": label, "overrides": dict(overrides) if overrides else None, "samples_per_s": None,
                           "verdict": None, "data_wait_fraction": None, "exit_code": None, "seconds": 0.0,
                           "error": None, "loaders": []}
    try:
        write_json(spec_path, spec | {"overrides": dict(overrides or {}), "out": str(out)})
    except Exception as e:
        failure = as_write_failure(e)
        run["error"] = (f"not run: its spec could not be written in {str(workdir)!r} ({failure}); free space "
                        "there or set TMPDIR to a folder with room")
        return run
    started = time.perf_counter()
    timed_out = False
    with log_path.open("wb") as output:
        proc = subprocess.Popen([sys.executable, "-m", "trainfast.diagnose.run.child", str(spec_path)],
                                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _end_group(proc)
            returncode = proc.wait()
    run["seconds"] = time.perf_counter() - started
    tail = _tail(log_path)
    last = tail.splitlines()[-1] if tail else ""
    if timed_out:
        run.update(error=f"timed out after {timeout_s:g} s and was killed" + (f"; last output: {last}" if last else ""),
                   output_tail=tail)
        return run
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        run.update(error=f"the verify process exited with code {returncode} without a report"
                   + (f": {last}" if last else ""), output_tail=tail)
        return run
    report = result.get("report") or {}
    loaders = [{k: loader.get(k) for k in ("index", "kind", *LOADER_KEYS)} for loader in report.get("loaders", [])]
    run.update(samples_per_s=report.get("samples_per_s"), verdict=report.get("verdict"),
               data_wait_fraction=report.get("data_wait_fraction"), exit_code=result.get("exit_code"),
               loaders=loaders)
    if result.get("exit_code"):
        lines = (result.get("error") or "").strip().splitlines() or [f"exit code {result.get('exit_code')}"]
        run["error"] = f"the script failed: {lines[-1]}"
    elif not run["samples_per_s"]:
        run["error"] = ("its samples could not be counted (no tensor found in the batches), so runs cannot be "
                        "compared by samples/s" if report.get("steps_measured") else
                        f"nothing measured: {report.get('verdict_reason') or 'no training step'}")
    elif overrides and not _applied(overrides, loaders):
        run["error"] = (f"the overrides {dict(overrides)} did not reach a DataLoader the measured steps used "
                        f"(loaders: {loaders})")
    if run["error"]:
        run["output_tail"] = tail
    return run


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


def verify_fixes(target: str, *, module: bool = False, args: Sequence[str] | None = None,
                 recommendations: Sequence[Recommendation], steps: int = 30, warmup: int = 5,
                 max_seconds: float | None = 300.0, repeats: int = 1, progress: Callable[[str], None] | None = None,
                 startup_margin_s: float = STARTUP_MARGIN_S) -> tuple[list[Recommendation], dict[str, Any]]:
    """Re-run `target` per fix with `overrides` (fresh processes, ABA with a baseline); return the
    recommendations with `measured_gain` filled and ranked (fixes/rule.py `rank`), and the record for
    `Report.verify`."""
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
                            "repeats": repeats, "steps": steps, "warmup": warmup, "baseline_drift": []}
    gains: dict[str, dict[str, Any]] = {
        r.id: {"median": None, "min": None, "max": None, "measured_repeats": 0, "error": invalid.get(r.id)}
        for r in recommendations if r.overrides}
    info["gains"] = gains
    if not fixes:
        info["note"] = "no fix could be injected into the script: nothing was re-run"
        return rank(recommendations), info

    plan: list[tuple[str, dict[str, Any] | None]] = [(BASELINE, None), *((r.id, o) for r, o in fixes),
                                                     (BASELINE, None)]
    total = len(plan) * repeats
    spec = {"target": target, "module": module, "args": list(args or []), "steps": steps, "warmup": warmup,
            "max_seconds": max_seconds}
    env, cwd = _child_env(), os.getcwd()
    timeout_s = None if max_seconds is None else max_seconds + startup_margin_s
    ratios: dict[str, list[float]] = {r.id: [] for r, _ in fixes}
    _free_device_memory()
    with tempfile.TemporaryDirectory(prefix="trainfast-verify-") as tmp:
        for repeat in range(repeats):
            this_repeat: list[dict[str, Any]] = []
            for label, overrides in plan:
                n = len(runs) + 1
                what = "baseline (the script unchanged)" if overrides is None else \
                    f"fix {label} ({_fmt_overrides(overrides)})"
                say(f"verify {n}/{total}: {what} ...")
                run = _run_child(label, overrides, spec, workdir=Path(tmp), name=f"run{n:03d}", env=env, cwd=cwd,
                                 timeout_s=timeout_s)
                run["repeat"] = repeat
                runs.append(run)
                this_repeat.append(run)
                if run["error"]:
                    say(f"verify {n}/{total}: {label} failed after {run['seconds']:.1f} s: {run['error']}")
                else:
                    say(f"verify {n}/{total}: {label}: {run['samples_per_s']:,.1f} samples/s "
                        f"in {run['seconds']:.1f} s")
            bases = [r for r in this_repeat if r["fix"] == BASELINE]
            info["baseline_samples_per_s"].extend(r["samples_per_s"] for r in bases)
            good = [r["samples_per_s"] for r in bases if not r["error"]]
            if len(good) == 2:
                info["baseline_drift"].append(good[1] / good[0])
            if not good:
                for r, _ in fixes:
                    gains[r.id]["error"] = gains[r.id]["error"] or "no baseline run measured anything"
                continue
            baseline = statistics.fmean(good)
            for run in this_repeat:
                if run["fix"] == BASELINE:
                    continue
                if run["error"]:
                    gains[run["fix"]]["error"] = gains[run["fix"]]["error"] or run["error"]
                else:
                    ratios[run["fix"]].append(run["samples_per_s"] / baseline)
    measured: dict[str, float] = {}
    for fix_id, values in ratios.items():
        if values:
            measured[fix_id] = statistics.median(values)
            gains[fix_id].update(median=measured[fix_id], min=min(values), max=max(values),
                                 measured_repeats=len(values))
    info["seconds"] = time.perf_counter() - started
    verified = [replace(r, measured_gain=measured[r.id], gain_basis="verified", basis_reason=None)
                if r.overrides and r.id in measured else r for r in recommendations]
    return rank(verified), info


def verify_report(report: Report, target: str, *, module: bool = False, args: Sequence[str] | None = None,
                  steps: int = 30, warmup: int = 5, max_seconds: float = 300.0, repeats: int = 1,
                  progress: Callable[[str], None] | None = None) -> Report:
    """`report` with its injectable fixes measured (`verify_fixes`): ranked by what they measured, the record of the
    runs in `verify`. What it does and how it goes is said through `progress` (one line at a time); interrupted
    (Ctrl-C, which also ends the child running), the report comes back unverified, its gains the estimated ones."""
    say = progress or (lambda line: None)
    fixes = [r for r in report.recommendations if r.overrides]
    if not fixes:
        say("verify: no fix to re-run: " + ("none of the fixes can be injected into the script without editing it"
                                            if report.recommendations else "the doctor recommended none"))
    else:
        runs = (len(fixes) + 2) * repeats
        say(f"verify: {runs} more run(s) of the script, each in a fresh process and up to {max_seconds:g} s: "
            f"baseline, {', '.join(r.id for r in fixes)}, baseline" + (f"; x{repeats}" if repeats > 1 else ""))
    try:
        ranked, info = verify_fixes(target, module=module, args=args, recommendations=report.recommendations,
                                    steps=steps, warmup=warmup, max_seconds=max_seconds, repeats=repeats,
                                    progress=say)
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
    return replace(report, recommendations=rank(ranked, by_run=report.whole_run is not None), verify=info)
