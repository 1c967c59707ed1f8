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
def test_runs_measures_two_versions_of_a_script_in_interleaved_pairs(tmp_path: Path) -> None:
    """Two versions of a script (another file, the same model and data) are what --runs compares; options may
    follow the scripts."""
    old = tmp_path / "old_train.py"
    old.write_text(SCRIPT.read_text())
    kept, out = tmp_path / "reports", tmp_path / "compare.json"
    done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--runs", "2", str(old), str(SCRIPT),
                           "--steps", "12", "--keep", str(kept), "--json", str(out), "--", *ARGS],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in kept.glob("*.json")) == ["base-1.json", "base-2.json", "new-1.json", "new-2.json"]
    order = [line.split(" ")[4] for line in done.stderr.splitlines() if line.startswith("run ")]
    assert order == ["BASE", "NEW", "NEW", "BASE"], done.stderr  # interleaved: BASE NEW, NEW BASE
    assert "2 pair(s) of runs: --runs" in done.stderr
    report = json.loads((kept / "new-2.json").read_text())
    assert report["script"]["args"] == ARGS and report["steps_measured"] == 12
    comparison = json.loads(out.read_text())
    assert comparison["runs"] == {"base": 2, "new": 2} and len(comparison["base"]) == 2
    assert comparison["gate"]["exit_code"] == 0 and "no --fail-slower given" in comparison["gate"]["verdict"]
    assert "comparable: machine: the same in all 4 runs" in done.stdout
    assert comparison["paired"] is True and "two versions of the script" in done.stdout


def test_runs_refuses_a_side_that_is_no_script(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainfast", "compare", "--runs", "2", str(tmp_path / "gone.py"),
                           str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--runs measures scripts: BASE" in done.stderr and "gone.py" in done.stderr
