"""`torchrun --nproc-per-node 2 -m trainfast doctor` on a DDP job whose rank 1 gets each batch ~60 ms late: one report
for the job (rank 0's), naming rank 1 as the straggler. Alone, rank 0's figures read communication-bound (it waits
for rank 1 inside backward, in DDP's all-reduce, which the doctor times) and rank 1's input-bound."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from trainfast.diagnose.show.html import render_html

SCRIPT = Path(__file__).parent / "scripts" / "ddp_straggler.py"
DELAY_S = 0.06
LIMIT_S = 120  # start-up (two interpreters importing torch, the rendezvous) takes 5-10 s here, the steps ~1 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(LIMIT_S + 30)]


def test_one_report_for_the_job_names_the_straggler(
        tmp_path: Path, torchrun: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    out = tmp_path / "out.json"
    done = torchrun("-m", "trainfast", "doctor", "--json", str(out), "--steps", "10", "--warmup", "2", str(SCRIPT),
                    "--", "--delay", str(DELAY_S), timeout=LIMIT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert done.stdout.count("verdict:") == 1, output[-6000:]  # one report: rank 0's
    assert done.stdout.count("JSON report:") == 1
    assert "trainfast doctor: rank 1 of 2 measured (stopped after 10 measured steps" in done.stdout
    assert "rank 0 prints the job's report" in done.stdout
    assert "samples/s over 2 ranks" in done.stdout
    assert "straggler: rank 1" in done.stdout

    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["rank"] == 0
    first, second = report["ranks"]
    assert [first["rank"], second["rank"]] == [0, 1]
    assert report["samples_per_s"] == pytest.approx(first["samples_per_s"] + second["samples_per_s"])
    assert first["verdict"] == "communication-bound" and second["verdict"] == "input-bound"  # each rank alone
    # rank 0's wait for rank 1 is its exposed communication, in the all-reduce DDP issued
    assert first["collectives"] == second["collectives"] == ["all-reduce"]
    assert first["communication_s"] > 0.7 * DELAY_S > second["communication_s"]
    assert first["fractions"]["communication"] > 0.5
    assert "in the all-reduce" in " ".join(done.stdout.split())
    # DDP's all-reduce beside its exposed part, from DDP's own timers (its iterations 1-10 fall in the window)
    for row in (first, second):
        ddp = row["ddp_all_reduce"]
        assert ddp["in_window"] and ddp["sampled_iterations"] >= 1, ddp
        assert 0 <= ddp["overlapped_s_per_iteration"] <= ddp["seconds_per_iteration"]
    assert first["ddp_all_reduce"]["seconds_per_iteration"] > 0.5 * DELAY_S  # rank 0's all-reduce waits for rank 1
    assert "DDP's all-reduce, by its own timers" in " ".join(done.stdout.split())
    # no fix of the collectives carries an assumed gain
    assert all(r["expected_gain"] is None for r in report["recommendations"] if r["id"] == "ddp_communication")
    straggler = report["straggler"]
    assert straggler["rank"] == 1 and straggler["phase"] == "input"
    assert 0.8 * DELAY_S < straggler["seconds_per_step"] < 3 * DELAY_S
    assert straggler["share"] > 0.5
    assert first["waiting_for_ranks"] > 0.5 and first["waiting_for_ranks_s"] > 0.7 * DELAY_S
    assert second["waiting_for_ranks"] == 0
    assert report["verdict"] == "input-bound" and "rank 1" in report["verdict_reason"]
    assert "holds the job back" in report["verdict_reason"]
    assert report["fractions"] == second["fractions"]  # the verdict's figures: the straggler's
    contention = report["contention"]
    if contention is not None and contention.get("sibling_cores_busy_mean"):  # rank 1 is not another process
        assert not any(note.startswith("other processes kept") for note in report["notes"])
    html = render_html(report)
    assert "Ranks" in html and "straggler" in html
