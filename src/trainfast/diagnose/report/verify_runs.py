"""One of `trainfast doctor --verify`'s runs of the script (report/verify.py): a fresh process
(`python -m trainfast.diagnose.run.child SPEC.json`, the doctor inside `apply_overrides`) with the one environment,
working directory and interpreter every run gets, killed with its loader workers on timeout, its report and the
script's own loss per step read back into the run's record; never raising for the script's or the child's
failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

from trainfast.atomic import as_write_failure, write_json
from trainfast.diagnose.capture.inject import LOADER_KEYS, needs_model
from trainfast.diagnose.records.losses import LossTrace

OUTPUT_TAIL_CHARS = 4000


def child_env() -> dict[str, str]:
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


def run_child(label: str, overrides: Mapping[str, Any] | None, spec: dict[str, Any], *, workdir: Path, name: str,
               env: dict[str, str], cwd: str, timeout_s: float | None) -> dict[str, Any]:
    """One fresh-process doctor run; never raises for the script's or the child's failure."""
    spec_path, out, log_path = (workdir / f"{name}.spec.json", workdir / f"{name}.out.json",
                                workdir / f"{name}.log")
    run: dict[str, Any] = {"fix": label, "overrides": dict(overrides) if overrides else None, "samples_per_s": None,
                           "verdict": None, "data_wait_fraction": None, "exit_code": None, "seconds": 0.0,
                           "error": None, "loaders": [], "loss": None, "losses": [],
                           "loss_from": None, "loss_steps": None, "loss_unseen": None}
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
    injected = result.get("injected") or {}
    loaders = [{k: loader.get(k) for k in ("index", "kind", *LOADER_KEYS)} for loader in report.get("loaders", [])]
    run.update(samples_per_s=_rate(report, whole_run=bool(spec.get("whole_run"))), verdict=report.get("verdict"),
               data_wait_fraction=report.get("data_wait_fraction"), exit_code=result.get("exit_code"),
               loaders=loaders, events=list(injected.get("events") or []), **_losses(result.get("loss")))
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
    elif overrides and needs_model(overrides) and not injected.get("model"):
        run["error"] = ("no model was seen training (a module with parameters requiring gradients, called in "
                        "training mode with gradients on): the fix acts on the model at its first training forward")
    elif injected.get("fell_back"):  # what it measured is eager's speed, not the compiled model's
        run["error"] = f"torch.compile fell back to eager: {injected['fell_back']}"
    if run["error"]:
        run["output_tail"] = tail
    return run


def _rate(report: Mapping[str, Any], *, whole_run: bool) -> float | None:
    """A run's figure: samples/s over its measured steps, or for a whole run its samples over its wall time (a fix
    of evaluation or checkpoints shows there, not in the steps)."""
    if not whole_run:
        return report.get("samples_per_s")
    whole = report.get("whole_run") or {}
    samples, wall = (whole.get("train") or {}).get("samples"), whole.get("wall_s")
    return samples / wall if samples and wall else None


def _losses(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """A run's loss keys (docs/json-report.md `verify.runs[]`): per step from `loss_from` (`losses`), the steps
    compared (`loss_steps`), the mean over the second half of those (`loss`), or why there is none (`loss_unseen`)."""
    trace = LossTrace.from_json(record)
    tail = trace.tail_steps
    over = trace.over(tail) if tail is not None else None
    unseen = trace.unseen or (None if over is not None else "no loss in its measured steps")
    return {"loss": over[0] if over else None, "losses": list(trace.values), "loss_from": trace.first,
            "loss_steps": list(trace.steps) if trace.steps else None, "loss_unseen": unseen}
