"""Data-parallel training through torchrun on the CPU (gloo): the CLI, bit-exact resume with 2 ranks after a
SIGTERM, a crashed rank under --max-restarts, SIGTERM delivered to torchrun itself (and so to every process of
each rank, loader workers included), and SIGTERM to a single process's whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def torchrun(*args: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            f"--max-restarts={restarts}", *args]


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in its own process group; on a timeout kill the whole group and fail with its stderr (the
    script's watchdog has dumped every rank's stacks there by then)."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd[-8:])} ran past {timeout} s; its stderr ends:\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def digests(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The uninterrupted 2-rank run every fault scenario must end exactly like."""
    root = tmp_path_factory.mktemp("reference")
    done = run(torchrun(str(SCRIPT), "--ckpt", str(root / "ckpt"), "--out", str(root / "out")))
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = digests(root / "out")
    assert first == second  # DDP: both ranks hold the same weights
    return first


def test_cli_train_under_torchrun(tiny_images: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = run(torchrun("-m", "trainfast", "train", "--data", str(tiny_images), "--image-size", "16",
                        "--batch-size", "8", "--epochs", "2", "--limit-batches", "4", "--workers", "1",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", "--json", str(out)))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 8 and result["epochs"] == 2
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert len(state["rng_per_rank"]) == 2 and state["step"] == 8


def test_sigterm_on_one_rank_stops_all_at_the_same_step_and_resumes_exactly(reference: dict[str, object],
                                                                           tmp_path: Path) -> None:
    stopped = run(torchrun(str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                           "--stop-at", "6"))
    assert stopped.returncode != 0  # the ranks exit 143; torchrun reports the job as failed
    assert stopped.stderr.count("stopped at epoch 2 batch 2 (step 6)") == 1  # rank 0 says it, once
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert (state["step"], state["epoch"], state["batch"]) == (6, 1, 2)
    resumed = run(torchrun(str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                           "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert digests(tmp_path / "out") == [reference, reference]  # no step lost, none repeated


def test_a_crashed_rank_is_restarted_and_the_job_finishes(reference: dict[str, object], tmp_path: Path) -> None:
    done = run(torchrun(str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                        "--crash-at", "6", "--resume", restarts=1))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 lost its GPU (simulated)" in done.stderr
    assert "attempt 1" in done.stderr and "resumed from" in done.stderr
    assert digests(tmp_path / "out") == [reference, reference]


def wait_for(marker: Path, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), "training never started: " + (proc.communicate(timeout=30)[1][-2000:]
                                                            if proc.poll() is not None else "still starting")


def stop_within_seconds(cmd: list[str], marker: Path, signal_it: Callable[[subprocess.Popen[str]], None],
                        ) -> tuple[int, float, str]:
    """Start `cmd`, signal it once training runs, return (exit status, seconds from signal to exit, stderr)."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(marker, proc)
        signalled = time.monotonic()
        signal_it(proc)
        _, stderr = proc.communicate(timeout=120)
        return proc.returncode, time.monotonic() - signalled, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def assert_stopped_here_and_resumes(tmp_path: Path, stderr: str, resume: list[str], steps: int,
                                    ranks: bool) -> None:
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert state["step"] >= 2 and "stopped at epoch" in stderr, stderr[-3000:]
    assert f"(step {state['step']})" in stderr  # the checkpoint is the stop point's, not the last epoch's
    # torchrun prints its own traceback when signalled; a rank's would start with "[rankN]:"
    ours = [line for line in stderr.splitlines() if "Traceback" in line and line.startswith("[rank" if ranks else "")]
    assert "is killed by signal" not in stderr and not ours, stderr[-3000:]
    resumed = run(resume)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / 'last.pt'}" in resumed.stderr
    assert json.loads((tmp_path / "out" / "rank0.json").read_text())["steps"] == steps


def test_sigterm_to_torchrun_with_workers_and_slow_steps_stops_within_seconds(tmp_path: Path) -> None:
    """A scheduler preempting the job signals torchrun, which forwards it to every rank (and their loader workers).
    The default log_every (50) is far beyond the run's steps: the ranks still agree to stop within seconds."""
    marker = tmp_path / "training"
    args = [str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--workers", "1",
            "--log-every", "50"]
    status, seconds, stderr = stop_within_seconds(torchrun(*args, "--slow", "0.3", "--marker", str(marker)), marker,
                                                  lambda proc: proc.send_signal(signal.SIGTERM))
    assert status != 0 and seconds < 10, (status, seconds, stderr[-3000:])
    assert_stopped_here_and_resumes(tmp_path, stderr, torchrun(*args, "--slow", "0.001", "--resume"), 12, ranks=True)


def test_sigterm_to_a_single_process_group_with_workers_stops_cleanly(tmp_path: Path) -> None:
    """`scancel` signals every process of the job: the loader workers must leave the stop to the main process."""
    marker = tmp_path / "training"
    args = [sys.executable, str(SCRIPT), "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
            "--workers", "2", "--log-every", "50"]
    status, seconds, stderr = stop_within_seconds([*args, "--slow", "0.2", "--marker", str(marker)], marker,
                                                  lambda proc: os.killpg(proc.pid, signal.SIGTERM))
    assert status == 143 and seconds < 10, (status, seconds, stderr[-3000:])
    assert_stopped_here_and_resumes(tmp_path, stderr, [*args, "--slow", "0.001", "--resume"], 24, ranks=False)
