"""`torchrun --nproc-per-node 2 -m trainfast doctor` on a DDP loop over gloo, rank 1 the slower one: every rank
stops at the same step, whatever stops it (the measured steps, the --max-seconds deadline, a SIGALRM), so no rank
is left inside an all-reduce its peer will never join; and `--verify` is refused there."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ddp_doctor_loop.py"
ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Start-up (two interpreters importing torch, rendezvous) takes 5-10 s here; a stop that is not collective
# leaves the other rank to gloo's 30-minute timeout, or to a connection reset when its peer exits.
LIMIT_S = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(LIMIT_S + 30)]


Torchrun = Callable[..., subprocess.CompletedProcess[str]]


def doctor_under_torchrun(torchrun: Torchrun, *args: str,
                          threads: int = 1) -> tuple[subprocess.CompletedProcess[str], float]:
    """`torchrun --nproc-per-node 2 -m trainfast doctor ARGS` and how long it took; past LIMIT_S it fails."""
    started = time.monotonic()
    done = torchrun("-m", "trainfast", "doctor", *args, timeout=LIMIT_S, env={"OMP_NUM_THREADS": str(threads)})
    return done, time.monotonic() - started


def steps_per_rank(out: Path) -> list[int]:
    return [json.loads((out / f"rank{rank}.json").read_text())["steps"] for rank in (0, 1)]


def test_the_deadline_stops_every_rank_at_the_same_step(tmp_path: Path, torchrun: Torchrun) -> None:
    """Rank 1 sleeps 8 ms per batch: its deadline, its SIGALRM and rank 0's fall at different steps. A whole run
    (--whole-run) stops at the deadline too, and the job's report holds each rank's phases."""
    report = tmp_path / "report.json"
    done, seconds = doctor_under_torchrun(torchrun, "--whole-run", "--json", str(report), "--max-seconds", "4",
                                          "--steps", "100000", str(SCRIPT), "--", str(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert output.count("stopped at the 4 s budget") == 2, output[-6000:]
    first, second = steps_per_rank(tmp_path)
    assert first == second > 10
    assert seconds < 60
    job = json.loads(report.read_text())
    for row in job["ranks"]:
        phases = row["whole_run"]["phases"]
        assert sum(phases.values()) == pytest.approx(row["whole_run"]["wall_s"], rel=0.01)
        assert phases["train"] > 0 and phases["startup"] > 0
    assert job["whole_run"]["train"]["steps"] >= first and "ranks' whole runs" in done.stdout


def test_the_measured_steps_stop_every_rank_at_the_same_step(tmp_path: Path, torchrun: Torchrun) -> None:
    """Two intra-op threads per rank: input-bound rank 1 measures a few more steps at one thread (the thread
    probe, before it proposes more loader workers), rank 0 does not, so their own step counts differ."""
    done, _ = doctor_under_torchrun(torchrun, "--steps", "20", "--warmup", "3", str(SCRIPT), "--", str(tmp_path),
                                    threads=2)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert output.count("stopped after 20 measured steps") == 2, output[-6000:]
    first, second = steps_per_rank(tmp_path)
    assert first == second >= 23


def test_without_torchruns_agent_the_store_of_rank_0s_process_group_is_used(tmp_path: Path) -> None:
    """Another launcher sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself: the script's init_process_group
    makes rank 0 host the store, which goes when rank 0 ends its group. Every rank has read the agreed step before."""
    with socket.socket() as free:  # a port for the rendezvous, released for rank 0's store to bind
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    procs = []
    started = time.monotonic()
    for rank in (0, 1):
        env = ENV | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)}
        # (a budget of 10 s, not 4: without torchrun's store a rank still in init_process_group when its alarm rings
        # has no agreement to propose to and stops there, before its loop; two busy loops beside the suite delayed
        # the other rank's start past 4 s)
        procs.append(subprocess.Popen([sys.executable, "-m", "trainfast", "doctor", "--max-seconds", "10", "--steps",
                                       "100000", str(SCRIPT), "--", str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - started)))[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the ranks ran past {LIMIT_S} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert all("stopped at the 10 s budget" in output for output in outputs)
    first, second = steps_per_rank(tmp_path)
    assert first == second > 10


def test_verify_is_refused_under_torchrun(tmp_path: Path, torchrun: Torchrun) -> None:
    done, _ = doctor_under_torchrun(torchrun, "--verify", str(SCRIPT), "--", str(tmp_path))
    assert done.returncode != 0
    assert "--verify cannot run under torchrun" in done.stderr, done.stderr[-3000:]
    assert "trainfast doctor --verify" in done.stderr  # the way out: single-process
    assert not (tmp_path / "rank0.json").exists()  # refused before the script ran
