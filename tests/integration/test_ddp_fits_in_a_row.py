"""Several `fit` calls in one torchrun process: each process group rendezvouses under its own store keys.

torchrun's store lives as long as the job. A second `init_process_group` that reused the first one's keys would
read the first group's entries (gloo: peer addresses that no longer listen; nccl: a stale unique id) and hang or
fail, so each group the process creates takes the next number in the store prefix."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ddp_fits_in_a_row.py"
TIMEOUT_S = 120  # the script's own watchdog (60 s) dumps every rank's stacks first
pytestmark = [pytest.mark.slow, pytest.mark.timeout(TIMEOUT_S + 30)]


def test_fits_one_after_another_in_one_torchrun_process(
        tmp_path: Path, torchrun: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    out = tmp_path / "out"
    done = torchrun(str(SCRIPT), str(out), timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first == second  # DDP: both ranks end with the same weights, after the same steps
    assert first["steps"] == [4] * 4  # 64 samples, batch 8, sharded over 2 ranks: 4 steps in each of the 4 fits
