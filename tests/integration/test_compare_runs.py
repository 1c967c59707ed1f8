"""`trainfast compare --runs N`: both sides measured here, each script under the doctor N times, alternately, then
compared; the reports kept with --keep (real doctor runs of a small loop)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "whole_run_loop.py"
ARGS = ["--epochs", "1", "--samples", "1536", "--width", "128", "--eval-every", "1000", "--save-every", "1000",
        "--workers", "0", "--precision", "fp32"]


@pytest.mark.slow
def test_runs_measures_both_scripts_alternately_and_compares_them(tmp_path: Path) -> None:
    kept, out = tmp_path / "reports", tmp_path / "compare.json"
    done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--runs", "2", "--steps", "12", "--keep",
                           str(kept), "--json", str(out), str(SCRIPT), str(SCRIPT), "--", *ARGS],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in kept.glob("*.json")) == ["base-1.json", "base-2.json", "new-1.json", "new-2.json"]
    order = [line.split(":")[0] for line in done.stderr.splitlines() if line.startswith("run ")]
    assert order == ["run 1/4", "run 2/4", "run 3/4", "run 4/4"] and "BASE" in done.stderr.splitlines()[0]
    report = json.loads((kept / "new-2.json").read_text())
    assert report["script"]["args"] == ARGS and report["steps_measured"] == 12
    comparison = json.loads(out.read_text())
    assert comparison["runs"] == {"base": 2, "new": 2} and len(comparison["base"]) == 2
    assert comparison["gate"]["exit_code"] == 0 and "no --fail-slower given" in comparison["gate"]["verdict"]
    assert "comparable: machine: the same in all 4 runs" in done.stdout


def test_runs_refuses_a_side_that_is_no_script(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--runs", "2", str(tmp_path / "gone.py"),
                           str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--runs measures scripts: BASE" in done.stderr and "gone.py" in done.stderr
