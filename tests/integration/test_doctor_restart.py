"""`torchrun --max-restarts 1 -m trainfast doctor --whole-run` on a DDP loop that resumes from its checkpoint: the
first attempt fails on rank 1 five steps after a checkpoint, and the report of the attempt that finishes counts
those steps as trained again, with the restart's time; the failed attempt's ranks do not wait for each other's
figures (that delayed the restart by a minute)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "restart_loop.py"
LIMIT_S = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(LIMIT_S + 30)]


def test_the_steps_since_the_last_checkpoint_are_lost_progress(tmp_path: Path,
                                                              torchrun: Callable[..., CompletedProcess[str]]) -> None:
    report = tmp_path / "report.json"
    started = time.monotonic()
    done = torchrun("--max-restarts", "1", "-m", "trainfast", "doctor", "--whole-run", "--json", str(report),
                    str(SCRIPT), "--", str(tmp_path), "--steps", "40", "--every", "10", "--fail-at", "25",
                    timeout=LIMIT_S)
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    resumed = [json.loads((tmp_path / f"attempt1_rank{r}.json").read_text())["resumed_at"] for r in (0, 1)]
    assert resumed == [20, 20]
    lost = json.loads(report.read_text())["whole_run"]["lost_progress"]
    (first,) = lost["attempts"]
    assert first["exact"] and first["steps"] == 25 and first["checkpoint_steps"] == 20 and first["steps_lost"] == 5
    assert "rank 1 fails at step 25" in first["ended"]
    assert 0 < first["restart_s"] < 30 and lost["restarts"] == 1
    assert "lost progress: 1 restart(s), 5 step(s)" in " ".join(done.stdout.split())
    assert "torchrun will restart the job" in done.stderr
    assert seconds < 60  # two attempts of a few seconds each, no minute-long gather in between
