"""The doctor on loader workers that wait on reads (a Dataset whose every read sleeps, as on object storage) and on
workers busy computing: the OS's CPU time per worker tells them apart, and only the waiting ones get more workers
than cores (Little's law); neither is told "fewer workers".

The script runs in this process on one intra-op thread (`one_intra_op_thread`): on two threads, with other processes
busy on both cores, its small step took 0.6-0.8 s of "compute" against 0.16 s per batch of reads, and the loop was
called compute-bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainfast.diagnose import run_doctor

SCRIPT = Path(__file__).parent / "scripts" / "waiting_reads.py"
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def doctor(*args: str, steps: int = 25) -> dict[str, Any]:
    run = run_doctor(str(SCRIPT), args=["--batch-size", "8", "--samples", "4096", *args], steps=steps, warmup=3,
                     max_seconds=60.0, monitor_interval_s=0.1, probe_gains=False)
    report: dict[str, Any] = run.report.to_json()
    assert run.exit_code == 0, run.error
    return report


@pytest.mark.slow
def test_workers_that_wait_on_reads_get_more_workers_than_cores() -> None:
    report = doctor("--workers", "2", "--latency-ms", "20")  # a batch: 8 reads of 20 ms in one worker
    workers = report["observed"]["workers"]
    assert workers is not None and workers["wait"] and workers["busy"] < 0.3, workers
    assert workers["batch_s"] == pytest.approx(0.16, rel=0.5)  # timed inside the workers
    assert report["verdict"] == "input-bound", report["fractions"]
    assert "wait on reads" in report["verdict_reason"]
    top = report["recommendations"][0]
    assert top["id"] == "num_workers" and top["gain_basis"] == "measured", top
    assert top["overrides"]["num_workers"] > 2 and "Little's law" in top["why"]  # beyond the 2 cores
    assert not any(r["id"] == "cpu_threads" for r in report["recommendations"])
    assert not any("would only share the same cores" in n for n in report["notes"])


@pytest.mark.slow
def test_workers_busy_computing_are_told_apart() -> None:
    report = doctor("--workers", "2", "--latency-ms", "0", "--work-ms", "3", steps=40)
    workers = report["observed"]["workers"]
    assert workers is not None and not workers["wait"] and workers["busy"] + (workers["queued"] or 0) > 0.5, workers
    assert "the workers themselves" in workers["source"]  # not the OS's per-process figures, which count idle time
    assert all("Little's law" not in r["why"] for r in report["recommendations"])


@pytest.mark.slow
def test_a_thread_loader_is_seen_and_its_threads_accounted_for() -> None:
    report = doctor("--workers", "2", "--latency-ms", "10", "--threads-loader", steps=15)
    assert report["loaders"][0]["kind"].startswith("trainfast ThreadLoader")
    workers = report["observed"]["workers"]
    assert workers is not None and workers["who"] == "the loader's threads" and workers["wait"], workers
    assert workers["batch_s"] == pytest.approx(0.08, rel=0.5)
    fix = next(r for r in report["recommendations"] if r["id"] == "num_workers")
    assert "backend='threads'" in fix["fix"] and fix["overrides"] is None  # --verify cannot inject threads


SPAWNED = '''
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Reads(Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.rand(8), i % 2


if __name__ == "__main__":
    loader = DataLoader(Reads(), batch_size=8, num_workers=1, multiprocessing_context="spawn")
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''


@pytest.mark.slow
def test_spawned_workers_still_start_under_the_doctor(tmp_path: Path) -> None:
    """The worker entry point the doctor wraps to time forked workers pickles as torch's own for spawn."""
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    run = run_doctor(str(script), steps=4, warmup=1, max_seconds=60.0, probe_gains=False)
    assert run.exit_code == 0, run.error
    assert run.report.to_json()["steps_measured"] == 4
