"""Fixtures of the GPU acceptance suite (`pytest -m gpu tests/gpu`): subprocess environments and a cached
`trainfast doctor` runner.

Every test here carries the `gpu` marker; tests/conftest.py skips them, with the reason, without CUDA. Nothing
in this file touches CUDA at import time, so the suite is collected on any machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Doctor runs: each is a fresh Python process (torch import and CUDA start-up, a few seconds) plus its steps;
# --max-seconds stops a script that runs slower than planned, the subprocess timeout one that hangs.
DOCTOR_MAX_SECONDS = 40
DOCTOR_TIMEOUT_S = 75


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment with src/ first on PYTHONPATH (gpu.sh runs without installing trainfast)."""
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": str(SRC) + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1",
                         **extra}


def run_python(args: list[str], *, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session", autouse=True)
def cuda_started() -> None:
    """Start CUDA once, before the first test's snapshot of the environment (tests/conftest.py's guard_globals):
    torch's CUDA start-up may change process-wide state of its own (older releases put
    CUDA_MODULE_LOADING=LAZY into os.environ), which is no test's leak. Skipped tests never get here."""
    if torch.cuda.is_available():
        torch.cuda.init()


PythonRun = Callable[..., "subprocess.CompletedProcess[str]"]
DoctorRun = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def python() -> PythonRun:
    """`python(args, timeout=..., **env)`: run this Python on `args` from the repository root, src/ importable.

    (A fixture rather than an import: the test modules cannot import this conftest by name.)"""
    return run_python


@pytest.fixture(scope="session")
def scripts() -> Path:
    """tests/gpu/scripts/."""
    return SCRIPTS


@pytest.fixture(scope="module")
def doctor(tmp_path_factory: pytest.TempPathFactory) -> DoctorRun:
    """`doctor(script, *script_args, warmup=3, steps=20)`: the JSON report of `trainfast doctor` on
    tests/gpu/scripts/`script`, with "_explain" added (the figures, for assertion messages); the same call
    within a module runs once (the transfer tests share a run)."""
    reports: dict[tuple[Any, ...], dict[str, Any]] = {}
    folder = tmp_path_factory.mktemp("doctor")

    def run(script: str, *script_args: str, warmup: int = 3, steps: int = 20) -> dict[str, Any]:
        key = (script, script_args, warmup, steps)
        if key not in reports:
            out = folder / f"report{len(reports)}.json"
            cmd = ["-m", "trainfast", "doctor", "--warmup", str(warmup), "--steps", str(steps), "--max-seconds",
                   str(DOCTOR_MAX_SECONDS), "--json", str(out), str(SCRIPTS / script)]
            if script_args:
                cmd += ["--", *script_args]
            done = run_python(cmd, timeout=DOCTOR_TIMEOUT_S)
            assert done.returncode == 0, f"doctor on {script} {script_args}: exit {done.returncode}\n" + \
                done.stdout[-3000:] + done.stderr[-3000:]
            report: dict[str, Any] = json.loads(out.read_text())
            report["_explain"] = explain(report, done.stdout[-3000:])  # for failure messages
            reports[key] = report
        return reports[key]
    return run


def explain(report: dict[str, Any], stdout: str) -> str:
    """The figures a failed assertion on a report should show."""
    observed = report.get("observed") or {}
    return (f"verdict {report.get('verdict')!r}: {report.get('verdict_reason')}\nfractions {report.get('fractions')}"
            f"\nintervals {report.get('fractions_interval')}\ngpu util {observed.get('gpu_util_mean')}, device busy "
            f"{observed.get('device_busy_fraction')}, device {observed.get('device')}\nsteps measured "
            f"{report.get('steps_measured')}, step_s {report.get('step_s')}\nnotes {report.get('notes')}\n"
            f"outcome {(report.get('script') or {}).get('outcome')}\n{stdout}")
