"""One report per torchrun job (ranks.py): each rank's summary, the straggler the others wait for in the all-reduce,
the job's figures, and the exchange through the job's store (a real TCPStore, as torchrun's agent hosts it)."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from rich.console import Console

from trainfast.diagnose.capture.stop import StoreStop
from trainfast.diagnose.evidence.noise import noise_notes
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import Fractions, StepRecord
from trainfast.diagnose.report import job as ranks
from trainfast.diagnose.report.job import STRAGGLER_SHARE, gather, job_figures, job_report, merge, rank_summary, send
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.show.html import render_html
from trainfast.diagnose.verdict import classify

NUM_WORKERS = Recommendation(id="num_workers", title="use 4 loader workers", why="data wait 91%", fix="num_workers=4",
                             expected_gain=8.0, overrides={"num_workers": 4})


def report(*, step_s: float = 0.070, wait_s: float = 0.0, transfer_s: float = 0.0, host_s: float = 0.0,
           steps: int = 10, samples: int = 8, recommendations: list[Recommendation] | None = None,
           contention: dict[str, Any] | None = None, notes: list[str] | None = None) -> Report:
    """A rank's report as build_report makes it, from `steps` alike steps."""
    records = [StepRecord(end_s=step_s * (i + 1), total_s=step_s, wait_s=wait_s, transfer_s=transfer_s,
                          host_s=host_s, samples=samples, syncs=0) for i in range(steps)]
    fractions = Fractions.of(total_s=step_s * steps, wait_s=wait_s * steps, transfer_s=transfer_s * steps,
                             host_s=host_s * steps)
    return Report(verdict=classify(fractions, device="cpu"), fractions=fractions, steps=records, warmup_steps=2,
                  samples_per_s=samples / step_s, step_s=step_s, loaders=[], recommendations=recommendations or [],
                  observed={}, step_spread={"p10": step_s, "p50": step_s, "p90": step_s}, input_source="loader",
                  script={"outcome": "stopped after 10 measured steps (2 warm-up)"}, contention=contention,
                  notes=list(notes or []))


def summaries(*reports: Report) -> list[dict[str, Any]]:
    return [rank_summary(r, rank=i, exit_code=0, host="node0") for i, r in enumerate(reports)]


def test_a_late_batch_on_one_rank_is_what_the_others_wait_for() -> None:
    """Rank 1 waits 64 ms per step for its batch; rank 0, whose batch is there, waits as long in the all-reduce,
    inside backward: its own figures read 96 % compute."""
    waiting, late = report(wait_s=0.001, host_s=0.002), report(wait_s=0.064, host_s=0.002)
    assert waiting.verdict is not None and waiting.verdict.name == "compute-bound"
    rows, straggler, notes = job_figures(summaries(waiting, late))
    assert straggler == {"rank": 1, "phase": "input", "seconds_per_step": pytest.approx(0.064),
                         "share": pytest.approx(0.064 / 0.070)}
    assert rows[0]["waiting_for_ranks_s"] == pytest.approx(0.063)
    assert rows[0]["waiting_for_ranks"] == pytest.approx(0.063 / 0.070)
    assert rows[1]["waiting_for_ranks_s"] == 0 and notes == []
    assert [row["verdict"] for row in rows] == ["compute-bound", "input-bound"]


@pytest.mark.parametrize(("parts", "phase"), [({"host_s": 0.030}, "host"), ({"transfer_s": 0.030}, "transfer"),
                                              ({"wait_s": 0.010, "host_s": 0.025}, "host")])
def test_the_straggler_s_phase_is_its_largest_part(parts: dict[str, float], phase: str) -> None:
    _, straggler, _ = job_figures(summaries(report(), report(**parts)))
    assert straggler is not None and straggler["rank"] == 1 and straggler["phase"] == phase


def test_a_gap_below_a_tenth_of_the_step_names_no_straggler() -> None:
    gap = 0.9 * STRAGGLER_SHARE * 0.070
    rows, straggler, _ = job_figures(summaries(report(wait_s=0.001), report(wait_s=0.001 + gap)))
    assert straggler is None
    assert rows[0]["waiting_for_ranks_s"] == pytest.approx(gap)  # measured all the same
    _, straggler, _ = job_figures(summaries(report(wait_s=0.001), report(wait_s=0.001 + 1.2 * gap / 0.9)))
    assert straggler is not None and straggler["rank"] == 1


def test_the_wait_is_never_more_than_the_waiting_rank_s_compute() -> None:
    """Within the lockstep tolerance a rank's compute can be shorter than the gap: the wait is taken out of its
    compute, so it stops there."""
    rows, straggler, _ = job_figures(summaries(report(step_s=0.060, wait_s=0.002), report(step_s=0.070,
                                                                                          wait_s=0.066)))
    assert straggler is not None
    assert rows[0]["waiting_for_ranks_s"] == pytest.approx(0.058)  # its compute, not 0.064


def test_ranks_not_in_lockstep_wait_for_no_one() -> None:
    """Without a collective every step each rank runs at its own pace: a slow rank holds no one back."""
    rows, straggler, notes = job_figures(summaries(report(step_s=0.005), report(step_s=0.070, wait_s=0.064)))
    assert straggler is None and all(row["waiting_for_ranks"] is None for row in rows)
    [note] = notes
    assert "do not run in lockstep" in note and "rank 0 5.0 ms" in note and "rank 1 70 ms" in note


def test_a_rank_that_measured_nothing_leaves_the_waits_unknown() -> None:
    idle = report()
    idle.steps, idle.fractions, idle.verdict, idle.samples_per_s = [], None, None, None
    rows, straggler, notes = job_figures(summaries(report(), idle))
    assert straggler is None and rows[1]["fractions"] is None
    assert notes == ["rank(s) 1 measured no step: no rank's wait for another can be told"]


def test_the_job_report_takes_its_verdict_split_and_fixes_from_the_straggler() -> None:
    first = report(wait_s=0.001, host_s=0.002)
    second = report(wait_s=0.064, host_s=0.002, recommendations=[NUM_WORKERS])
    job = merge(first, dict(enumerate(summaries(first, second))), world_size=2)
    assert job.world_size == 2 and job.rank == 0
    assert job.samples_per_s == pytest.approx(2 * 8 / 0.070)  # each rank trains its own batches
    assert job.verdict is not None and job.verdict.name == "input-bound"
    assert job.verdict.reason.startswith("on rank 1: its data wait (64 ms/step, 91% of its step) holds the job "
                                         "back; the other rank(s) wait 63 ms/step for it in the collectives")
    assert job.fractions == second.fractions
    assert [r.id for r in job.recommendations] == ["num_workers"]
    assert job.recommendations[0].overrides == {"num_workers": 4}
    assert any("rank 0's, whose communication and compute include 63 ms/step of waiting for rank 1" in n
               for n in job.notes)
    data = job.to_json()
    assert data["straggler"]["rank"] == 1 and data["straggler"]["phase"] == "input"
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][0]["waiting_for_ranks"] > 0.8
    assert data["steps_measured"] == 10  # rank 0's own steps, as before


def test_without_a_straggler_rank_0_s_verdict_stands() -> None:
    first, second = report(wait_s=0.020), report(wait_s=0.021)
    job = merge(first, dict(enumerate(summaries(first, second))), world_size=2)
    assert job.straggler is None and job.verdict == first.verdict and job.fractions == first.fractions


def test_a_rank_that_sent_nothing_is_named_and_the_job_rate_is_unknown() -> None:
    first = report()
    job = merge(first, {0: rank_summary(first, rank=0, exit_code=0)}, world_size=3,
                why_missing="the job's store failed: DistNetworkError: Connection reset")
    assert job.samples_per_s is None and job.straggler is None
    assert job.ranks is not None and [r["rank"] for r in job.ranks] == [0]
    assert ("rank(s) 1, 2 of 3 sent no figures (the job's store failed: DistNetworkError: Connection reset)"
            in job.notes[-1])


def test_a_crashed_rank_is_in_the_notes() -> None:
    first, second = report(), report()
    sent = summaries(first, second)
    sent[1] |= {"exit_code": 1, "outcome": "the script crashed: ValueError: bad batch"}
    job = merge(first, dict(enumerate(sent)), world_size=2)
    assert "rank 1: the script crashed: ValueError: bad batch" in job.notes


def test_the_other_ranks_here_are_not_other_processes() -> None:
    """Rank 0's monitor counts rank 1's CPU use (on the same machine) among other processes."""
    contention = {"other_cores_busy_mean": 0.8, "other_cores_busy_max": 1.0, "cores": 2, "samples": 3,
                  "own_cores_busy_mean": 0.9}
    before = noise_notes(None, contention)
    assert before and "other processes kept 0.8 of 2 cores busy" in before[0]
    first = report(contention=contention, notes=["first", *before, "last"])
    second = report(contention=contention | {"own_cores_busy_mean": 0.7})
    sent = [rank_summary(r, rank=i, exit_code=0) for i, r in enumerate((first, second))]  # this machine's name
    job = merge(first, dict(enumerate(sent)), world_size=2)
    assert job.contention is not None
    assert job.contention["other_cores_busy_mean"] == pytest.approx(0.1)
    assert job.contention["sibling_cores_busy_mean"] == pytest.approx(0.7)
    assert job.notes[:2] == ["first", "last"]  # no contention left to note
    elsewhere = [s | {"host": socket.gethostname() + "-other"} if s["rank"] else s for s in sent]
    assert merge(first, dict(enumerate(elsewhere)), world_size=2).contention == contention  # another machine's


def test_a_sibling_adjusted_contention_note_says_so() -> None:
    contention = {"other_cores_busy_mean": 1.5, "other_cores_busy_max": 2.0, "cores": 4, "samples": 3}
    [note] = noise_notes(None, contention | {"sibling_cores_busy_mean": 0.9})
    assert note.startswith("other processes (not counting this job's other ranks here, 0.9 cores) kept 1.5 of 4")


def test_the_terminal_shows_the_job_s_rate_the_ranks_and_the_straggler() -> None:
    first, second = report(wait_s=0.001), report(wait_s=0.064)
    job = merge(first, dict(enumerate(summaries(first, second))), world_size=2)
    console = Console(record=True, width=140)
    job.render(console)
    text = console.export_text()
    assert text.count("verdict:") == 1 and "verdict: INPUT-BOUND — on rank 1: its data wait" in text
    assert "job: 229 samples/s over 2 ranks" in text
    assert "straggler: rank 1 — its data wait (64 ms/step, 91% of its step) holds the job back" in text
    assert "63 ms (90%)" in text  # rank 0's wait in the ranks table


def test_the_html_report_has_a_row_per_rank_and_the_straggler() -> None:
    first, second = report(wait_s=0.001), report(wait_s=0.064)
    page = render_html(merge(first, dict(enumerate(summaries(first, second))), world_size=2).to_json())
    assert '<section id="ranks"><h2>Ranks</h2>' in page and "samples / s over 2 ranks" in page
    assert "straggler: rank 1, input: 64.0 ms per step (91% of its step)" in page
    assert "63.0 ms (90%)" in page
    assert 'id="ranks"' not in render_html(report().to_json())  # a single process: no such section


def test_a_single_process_report_keeps_its_keys() -> None:
    data = report().to_json()
    assert data["world_size"] == 1 and data["rank"] == 0 and data["ranks"] is None and data["straggler"] is None
    console = Console(record=True, width=140)
    report().render(console)  # no line about ranks
    assert "ranks" not in console.export_text() and "straggler" not in console.export_text()


# --- the exchange through the job's store -------------------------------------------------------------------


def agreement(server: Any, rank: int, prefix: str = "trainfast/doctor/attempt_0/run_0/") -> StoreStop:
    def connect() -> Any:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=10))
        return dist.PrefixStore(prefix, client)
    return StoreStop(connect, rank)


def in_thread(rank: int, of: Report, server: Any, world_size: int = 2) -> tuple[threading.Thread, list[Any]]:
    """`job_report` of a rank other than 0, which waits for rank 0's receipt, in a thread: [(report, published)]."""
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(job_report(of, agreement(server, rank),
                                                                    world_size=world_size, exit_code=0)))
    thread.start()
    return thread, done


def test_rank_0_gathers_the_other_ranks_figures_through_the_store(server: Any) -> None:
    first, second = report(wait_s=0.001), report(wait_s=0.064, recommendations=[NUM_WORKERS])
    thread, done = in_thread(1, second, server)
    job, _ = job_report(first, agreement(server, 0), world_size=2, exit_code=0)
    thread.join(timeout=10)
    [(sent, published)] = done
    assert published and sent.rank == 1 and sent.world_size == 2 and sent.ranks is None
    assert job.rank == 0 and job.straggler is not None and job.straggler["rank"] == 1
    assert second.fractions is not None and job.ranks is not None
    assert job.ranks[1]["fractions"] == second.fractions.to_json()
    # another doctor run in the same job (its own key prefix) does not read this run's figures
    found, _ = gather(agreement(server, 0, prefix="trainfast/doctor/attempt_0/run_1/"), 2, timeout_s=0.1)
    assert found == {}


def test_rank_0_waits_for_a_late_rank(server: Any) -> None:
    done: list[str | None] = []
    late = threading.Timer(0.3, lambda: done.append(send(agreement(server, 1), {"rank": 1}, timeout_s=10)))
    late.start()
    try:
        found, error = gather(agreement(server, 0), 2, timeout_s=10)
    finally:
        late.join()
    assert error is None and found == {1: {"rank": 1}} and done == [None]


def test_a_rank_whose_figures_rank_0_did_not_take_shows_its_own(server: Any) -> None:
    """No receipt (rank 0 never gathered: its store went with its process group), or one without this rank (it
    came after rank 0 stopped waiting): the rank's own report is the only place its figures show."""
    assert send(agreement(server, 1), {"rank": 1}, timeout_s=0.2) == "rank 0 did not take them within 0.2 s"
    assert gather(agreement(server, 0), 3, timeout_s=0.1) == ({1: {"rank": 1}}, None)
    assert send(agreement(server, 2), {"rank": 2}, timeout_s=5) == "rank 0 stopped waiting for them"


def test_a_rank_that_never_sends_is_named_after_the_timeout(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranks, "GATHER_TIMEOUT_S", 0.2)
    found, error = gather(agreement(server, 0), 3, timeout_s=0.2)
    assert found == {} and error is None
    thread, _ = in_thread(2, report(), server, world_size=3)
    job, _ = job_report(report(), agreement(server, 0), world_size=3, exit_code=0)
    thread.join(timeout=10)
    assert job.ranks is not None and [r["rank"] for r in job.ranks] == [0, 2]
    assert any(n.startswith("rank(s) 1 of 3 sent no figures within 0.2 s: they are not in this report")
               for n in job.notes)


def test_a_store_out_of_reach_is_said_not_waited_for() -> None:
    def unreachable() -> Any:
        raise dist.DistStoreError("connect() timed out")
    found, error = gather(StoreStop(unreachable, 0), 2, timeout_s=30)
    assert found == {} and error == "the job's store failed: DistStoreError: connect() timed out"
    assert send(StoreStop(unreachable, 1), {"rank": 1}) == "the job's store failed: DistStoreError: connect() timed out"
    sent, published = job_report(report(), StoreStop(unreachable, 1), world_size=2, exit_code=0)
    assert not published and sent.rank == 1  # the CLI then shows this rank's own report
    job, _ = job_report(report(), None, world_size=2, exit_code=0)
    assert job.samples_per_s is None and "(no store to gather them through)" in job.notes[-1]


def test_the_stragglers_fixes_keep_their_basis_in_the_jobs_report() -> None:
    """Rank 0 shows the straggler's fixes from its summary: measured ones stay measured, estimates keep their reason,
    a whole run's gain stays (gains as the JSON rounds them)."""
    fixes = [Recommendation("num_workers", "t", "w", "f", 1.6, overrides={"num_workers": 2}, gain_basis="measured",
                            run_gain=1.25),
             Recommendation("startup", "t", "w", "", None, basis_reason="named with its seconds")]
    assert [Recommendation.from_json(r.to_json()) for r in fixes] == fixes
