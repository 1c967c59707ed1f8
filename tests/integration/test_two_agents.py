"""A 2-rank job launched as on two machines: one torchrun agent per "machine" (`--nnodes 2 --nproc-per-node 1`, a c10d
rendezvous on localhost, the `two_agents` fixture), each agent's output apart as on its own machine. The doctor gives
one report for the job, `trainfast train` ends 0 on both, and SIGTERM to one agent stops both at the same step with a
checkpoint the resumed run continues from exactly."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # the fixture's type; at run time `conftest` may name another folder's conftest
    from conftest import TwoAgents

SCRIPTS = Path(__file__).parent / "scripts"
DELAY_S = 0.06  # rank 1's late batches in ddp_straggler.py
SLOW_S = 0.3  # ddp_train.py's sleep per forward: the stop agreement (every ~2 s) falls mid-training, at step ~8 of 12
LIMIT_S = 120  # start-up (two agents, a rendezvous, two interpreters importing torch) takes 5-10 s here
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * LIMIT_S + 30)]


def rank0_agent(runs: tuple[subprocess.CompletedProcess[str], ...]) -> int:
    """Which agent's worker the rendezvous made rank 0 (the lower pid: in practice the first agent started)."""
    agents = [i for i, run in enumerate(runs) if "distributed: rank 0 of 2" in run.stderr]
    assert len(agents) == 1, [run.stderr[-2000:] for run in runs]
    return agents[0]


def outputs(runs: tuple[subprocess.CompletedProcess[str], ...]) -> str:
    return "\n".join(f"--- agent {i} (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-4000:]}"
                     for i, run in enumerate(runs))


def test_the_doctor_gives_one_report_for_the_job_and_names_the_straggler(tmp_path: Path,
                                                                         two_agents: TwoAgents) -> None:
    out = tmp_path / "out.json"
    runs = two_agents("-m", "trainfast", "doctor", "--json", str(out), "--steps", "10", "--warmup", "2",
                      str(SCRIPTS / "ddp_straggler.py"), "--", "--delay", str(DELAY_S), timeout=LIMIT_S)
    assert [run.returncode for run in runs] == [0, 0], outputs(runs)
    reports = [i for i, run in enumerate(runs) if "verdict:" in run.stdout]
    assert len(reports) == 1 and runs[reports[0]].stdout.count("verdict:") == 1, outputs(runs)  # rank 0's machine
    other = runs[1 - reports[0]].stdout
    assert "trainfast doctor: rank 1 of 2 measured" in other and "rank 0 prints the job's report" in other
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and [row["rank"] for row in report["ranks"]] == [0, 1]
    assert report["straggler"]["rank"] == 1 and report["straggler"]["phase"] == "input"
    assert "straggler: rank 1" in runs[reports[0]].stdout


def test_train_ends_on_both_agents_with_a_checkpoint(tiny_images: Path, tmp_path: Path,
                                                     two_agents: TwoAgents) -> None:
    result = tmp_path / "result.json"
    runs = two_agents("-m", "trainfast", "train", "--data", str(tiny_images), "--image-size", "16",
                      "--batch-size", "8", "--epochs", "2", "--limit-batches", "4", "--workers", "1",
                      "--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", "--json", str(result),
                      timeout=LIMIT_S)
    assert [run.returncode for run in runs] == [0, 0], outputs(runs)
    main = rank0_agent(runs)
    assert "trained 2 epoch(s), 8 steps" in runs[main].stdout and not runs[1 - main].stdout  # one rank speaks
    assert json.loads(result.read_text())["steps"] == 8
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert state["step"] == 8 and len(state["rng_per_rank"]) == 2


def weights(out: Path) -> list[str]:
    return [json.loads((out / f"rank{rank}.json").read_text())["digest"] for rank in (0, 1)]


def test_sigterm_to_one_agent_stops_both_and_the_resume_continues_exactly(tmp_path: Path,
                                                                          two_agents: TwoAgents) -> None:
    """A preempted machine: its agent gets SIGTERM and forwards it to its worker only. The other machine's worker
    learns of it at the ranks' next stop agreement (about every 2 s); both stop at that step, rank 0 saves, and each
    agent ends (torchrun reports the job failed: the workers exit 143). Resumed, the job ends with the weights of a
    run never stopped (ddp_train.py's digest of every parameter), so no step was lost or repeated."""
    def job(name: str, *extra: str, interrupt: object = None) -> tuple[subprocess.CompletedProcess[str], ...]:
        return two_agents(str(SCRIPTS / "ddp_train.py"), "--ckpt", str(tmp_path / name / "ckpt"), "--out",
                          str(tmp_path / name / "out"), "--workers", "1", "--log-every", "50", "--slow", str(SLOW_S),
                          *extra, timeout=LIMIT_S, interrupt=interrupt)

    reference = job("reference")
    assert [run.returncode for run in reference] == [0, 0], outputs(reference)
    first, second = weights(tmp_path / "reference" / "out")
    assert first == second

    marker = tmp_path / "training"  # written at the third training step
    stop = two_agents.Interrupt(agent=0, when=marker)  # the agent hosting the rendezvous store, as HOST0 does
    stopped = job("stopped", "--marker", str(marker), interrupt=stop)
    assert stop.ended_after_s is not None, outputs(stopped)
    assert [run.returncode for run in stopped] == [1, 1], outputs(stopped)  # torchrun: the job failed
    main = rank0_agent(stopped)
    said = re.search(r"stopped at epoch \d+ batch \d+ \(step (\d+)\); saved", stopped[main].stderr)
    assert said is not None, outputs(stopped)
    state = torch.load(tmp_path / "stopped" / "ckpt" / "last.pt", weights_only=True)
    assert state["step"] == int(said.group(1)) < 12 and len(state["rng_per_rank"]) == 2
    assert "SIGTERM received" in stopped[0].stderr  # the signalled agent's worker
    # each machine's log says why its worker stopped: rank 1's too, wherever the signal came
    assert f"rank 1: stopped at step {said.group(1)} with every rank" in stopped[1 - main].stderr, outputs(stopped)
    assert "exitcode: 143" in stopped[1].stderr  # the other agent's worker stopped as agreed, not killed
    frames = [line for run in stopped for line in run.stderr.splitlines()
              if line.lstrip().startswith("File ") and "/torch/" not in line and "<frozen" not in line]
    assert not frames, outputs(stopped)  # the agents' own tracebacks only: no worker raised
    assert stop.ended_after_s < 20, (stop.ended_after_s, outputs(stopped))  # torchrun kills its workers at 30 s

    resumed = job("stopped", "--resume")
    assert [run.returncode for run in resumed] == [0, 0], outputs(resumed)
    assert f"resumed from {tmp_path / 'stopped' / 'ckpt' / 'last.pt'}" in resumed[rank0_agent(resumed)].stderr
    assert weights(tmp_path / "stopped" / "out") == [first, first]  # the uninterrupted run's weights

