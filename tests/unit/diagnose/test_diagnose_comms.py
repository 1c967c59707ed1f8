"""Communication as its own part of the step (comms.py, timeline.py, classify.py, recommend.py, ranks.py), with
made-up numbers: the verdict, the fix and its estimate, and the job's rows."""

from __future__ import annotations

import time
from typing import Any

import pytest

from trainfast.diagnose.capture.comms import CommTotals, KindStats
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.evidence.comms import Collectives, collective_words
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes import RULES
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import Fractions, StepRecord
from trainfast.diagnose.records.trials import Trial, Trials
from trainfast.diagnose.report.job import job_figures, rank_summary
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.verdict import LIMIT_SHARE, classify


def fractions(comm: float, host: float = 0.02) -> Fractions:
    return Fractions.of(total_s=1.0, wait_s=0.01, transfer_s=0.0, host_s=host, comm_s=comm)


def test_exposed_communication_comes_out_of_compute_and_can_be_the_verdict() -> None:
    f = fractions(0.4)
    assert f.communication == 0.4 and f.compute == pytest.approx(0.57)
    assert sum(f.to_json().values()) == pytest.approx(1.0)
    verdict = classify(f, device="cpu")
    assert verdict.name == "communication-bound" and "collectives" in verdict.reason
    assert classify(fractions(LIMIT_SHARE - 0.05), device="cpu").name == "balanced"
    assert classify(fractions(0.05), device="cpu").name == "compute-bound"
    # a noisy share: limit on average, not at the interval's low end
    noisy = classify(f, device="cpu", intervals={"communication": (0.1, 0.6)})
    assert noisy.name == "balanced"


def test_the_timeline_books_collectives_as_communication_and_the_parts_add_up() -> None:
    timeline = Timeline(warmup_steps=0)
    for _ in range(3):
        timeline.forward(time.perf_counter(), 8)
        time.sleep(0.004)  # the step, of which 2 ms were blocked in a collective
        timeline.communicated(0.002)
        timeline.backward()
    timeline.finish()
    records = timeline.records
    assert records and all(r.comm_s == pytest.approx(0.002) for r in records)
    for r in records:
        assert r.wait_s + r.transfer_s + r.host_s + r.collect_s + r.comm_s + r.compute_s == pytest.approx(r.total_s)
    clipped = StepRecord(end_s=0.0, total_s=0.001, wait_s=0.0, transfer_s=0.0, host_s=0.0, samples=1, syncs=0,
                         comm_s=0.002)
    assert clipped.compute_s == 0.0


def test_the_totals_over_the_measured_window() -> None:
    start = CommTotals({"all-gather": KindStats(4, 400, 0.4, 0.2)}, steps=2)
    end = CommTotals({"all-gather": KindStats(10, 1000, 1.0, 0.5), "reduce-scatter": KindStats(3, 30, 0.3, 0.3)},
                     steps=5)
    window = end.since(start)
    assert window.steps == 3 and window.kinds["all-gather"].count == 6
    assert window.kinds["reduce-scatter"].exposed_s == pytest.approx(0.3)
    assert collective_words(["all-gather", "reduce-scatter"]) == "the all-gathers and reduce-scatters"
    assert collective_words(["all-reduce", "barrier"]) == "the all-reduce"
    assert collective_words([]) == "the collectives"


def evidence(comm: float, collectives: dict[str, Any] | None, trials: Trials | None = None) -> Evidence:
    return Evidence(verdict="communication-bound", device="cpu", fractions=fractions(comm), step_s=0.1, steps=10,
                    samples_per_s=100.0, syncs_per_step=0.0, cpus=2, collectives=Collectives.of(collectives),
                    trials=trials)


def communication(e: Evidence) -> Recommendation | None:
    """The collectives' fix, whichever of its rules proposes it (one at most: they follow the wrapper)."""
    found = [r for rule in RULES if rule.acts_on == "collectives" and (r := rule.propose(e)) is not None]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_the_fix_follows_the_wrapper_and_no_gain_is_assumed() -> None:
    ddp = {"kinds": {"all-reduce": {}}, "wrappers": ["ddp"], "ddp_gradient_as_bucket_view": False}
    fix = communication(evidence(0.4, ddp))
    assert fix is not None and fix.id == "ddp_communication" and "gradient_as_bucket_view=True" in fix.fix
    assert fix.expected_gain is None and fix.basis_reason and "fixed when it is built" in fix.basis_reason
    viewed = communication(evidence(0.4, ddp | {"ddp_gradient_as_bucket_view": True}))
    assert viewed is not None and "gradient_as_bucket_view" not in viewed.fix
    fsdp = {"kinds": {"all-gather": {}, "reduce-scatter": {}}, "wrappers": ["fsdp2"]}
    fix = communication(evidence(0.4, fsdp))
    assert fix is not None and fix.id == "fsdp_communication" and "reshard_after_forward=False" in fix.fix
    assert fix.expected_gain is None and fix.basis_reason and "not measured" in fix.basis_reason
    own = communication(evidence(0.2, {"kinds": {"all-reduce": {}}, "wrappers": []}))
    assert own is not None and own.id == "fewer_collectives" and own.expected_gain is None
    assert communication(evidence(0.03, fsdp)) is None  # a small cost
    assert communication(evidence(0.4, None)) is None  # no collective seen


def test_fsdp_communication_carries_the_gain_measured_on_the_jobs_steps() -> None:
    fsdp = {"kinds": {"all-gather": {}, "reduce-scatter": {}}, "wrappers": ["fsdp2"]}
    faster = Trial.of_rounds("fsdp_reshard", "kept gathered", [1.21] * 5 + [1.25] * 4 + [0.9] * 3, [0.1] * 12,
                             value=False)
    fix = communication(evidence(0.4, fsdp, Trials({"fsdp_reshard": faster})))
    assert fix is not None and fix.gain_basis == "measured" and fix.expected_gain == pytest.approx(1.21)
    assert "12 pairs of adjacent steps, 9 faster; faster" in fix.why  # decided by trainfast.decide
    # half the pairs faster by a lot, half slower by as much: no gain the pairs can tell
    lucky = Trial.of_rounds("fsdp_reshard", "kept gathered", [1.2] * 6 + [0.85] * 6, [0.1] * 12, value=False)
    fix = communication(evidence(0.4, fsdp, Trials({"fsdp_reshard": lucky})))
    assert fix is not None and fix.expected_gain is None
    assert "12 pairs of adjacent steps, 6 faster; inconclusive" in (fix.basis_reason or "")
    # measured faster where little is exposed: the measurement stands
    small = communication(evidence(0.03, fsdp, Trials({"fsdp_reshard": faster})))
    assert small is not None and small.expected_gain == pytest.approx(1.21)
    same = Trial.of_rounds("fsdp_reshard", "kept gathered", [0.97, 1.01, 0.99], [0.1, 0.1, 0.1], value=False)
    fix = communication(evidence(0.4, fsdp, Trials({"fsdp_reshard": same})))
    assert fix is not None and fix.expected_gain is None and fix.basis_reason
    assert "0.99x" in fix.basis_reason and "no gain" in fix.basis_reason
    cut = Trial("fsdp_reshard", "kept gathered", reason="the run ended inside the trial's 25 steps")
    fix = communication(evidence(0.4, fsdp, Trials({"fsdp_reshard": cut})))
    assert fix is not None and fix.expected_gain is None and "ended inside" in (fix.basis_reason or "")


def rank_report(*, comm_s: float, wait_s: float, kinds: list[str]) -> Report:
    step_s, steps = 0.070, 10
    records = [StepRecord(end_s=step_s * (i + 1), total_s=step_s, wait_s=wait_s, transfer_s=0.0, host_s=0.0,
                          samples=8, syncs=0, comm_s=comm_s) for i in range(steps)]
    f = Fractions.of(total_s=step_s, wait_s=wait_s, transfer_s=0.0, host_s=0.0, comm_s=comm_s)
    observed = {"collectives": {"kinds": {k: {} for k in kinds}, "seconds_per_step": comm_s + 0.001}}
    return Report(verdict=classify(f, device="cpu"), fractions=f, steps=records, warmup_steps=2,
                  samples_per_s=8 / step_s, step_s=step_s, loaders=[], recommendations=[], observed=observed,
                  step_spread={"p10": step_s, "p50": step_s, "p90": step_s}, input_source="loader")


def test_the_job_rows_hold_each_ranks_communication_and_its_wait_is_within_it() -> None:
    """Rank 0 waits 60 ms a step in the all-reduce for rank 1's late batch: booked as its exposed communication, which
    is where its wait for rank 1 is counted (not more than its communication and compute)."""
    waiting = rank_report(comm_s=0.060, wait_s=0.001, kinds=["all-reduce"])
    late = rank_report(comm_s=0.002, wait_s=0.061, kinds=["all-reduce"])
    assert waiting.verdict is not None and waiting.verdict.name == "communication-bound"
    summaries = [rank_summary(r, rank=i, exit_code=0, host="node0") for i, r in enumerate((waiting, late))]
    rows, straggler, _ = job_figures(summaries)
    assert [row["communication_s"] for row in rows] == [pytest.approx(0.060), pytest.approx(0.002)]
    assert rows[0]["communication_total_s"] == pytest.approx(0.061) and rows[0]["collectives"] == ["all-reduce"]
    assert rows[0]["waiting_for_ranks_s"] == pytest.approx(0.060)
    assert straggler is not None and straggler["rank"] == 1
