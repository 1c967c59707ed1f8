"""Noise and contention in the doctor's report: the step-time spread, other processes' CPU, null figures."""

from __future__ import annotations

import pytest
import torch

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.evidence import noise
from trainfast.diagnose.records.steps import StepRecord
from trainfast.diagnose.run import build_report


class SeriesMonitor:
    """The part of a Monitor the report reads: named series on a clock that started at `started_at`."""

    def __init__(self, started_at: float, series: dict[str, list[tuple[float, float]]]) -> None:
        self.started_at = started_at
        self._series = series

    def metrics(self) -> list[str]:
        return sorted(self._series)

    def series(self, name: str) -> tuple[list[float], list[float]]:
        return [t for t, _ in self._series[name]], [v for _, v in self._series[name]]


def step(total: float) -> StepRecord:
    return StepRecord(end_s=0.0, total_s=total, wait_s=0.0, transfer_s=0.0, host_s=0.0, samples=8, syncs=0)


def test_the_spread_of_the_issue_run_is_flagged() -> None:
    """7 of 20 steps took 1.2-7.1 s, 13 took 0.2 s: the median alone would say 219 ms."""
    slow = [1.2, 2.0, 3.1, 4.4, 5.0, 6.2, 7.1]
    spread = noise.spread([step(0.219)] * 13 + [step(s) for s in slow])
    assert spread is not None and spread["p50"] == pytest.approx(0.219) and spread["p90"] > 5
    [note] = noise.noise_notes(spread, None)
    assert "vary widely" in note and "p50 219.0 ms" in note and "unreliable" in note
    assert noise.noise_notes(noise.spread([step(0.2), step(0.21), step(0.22)]), None) == []
    assert noise.spread([]) is None


def test_other_processes_cpu_is_what_the_cores_did_beyond_this_process() -> None:
    # 2 cores at 90 % = 180 % busy; this process 60 % and its workers 20 %: others kept 1.0 core busy
    monitor = SeriesMonitor(started_at=1000.0, series={
        "cpu.percent": [(0.5, 10.0), (1.5, 90.0), (2.5, 90.0)], "cpu0.percent": [(0.5, 0.0)],
        "cpu1.percent": [(0.5, 0.0)], "proc.cpu_percent": [(0.5, 0.0), (1.5, 60.0), (2.5, 60.0)],
        "workers.cpu_percent": [(0.5, 0.0), (1.5, 20.0), (2.5, 20.0)]})
    found = noise.contention(monitor, measuring_from=1001.0)  # the sample at 0.5 s was warm-up
    assert found is not None and found["cores"] == 2 and found["samples"] == 2
    assert found["other_cores_busy_mean"] == pytest.approx(1.0)
    [note] = noise.noise_notes(None, found)
    assert "other processes kept 1.0 of 2 cores busy" in note
    assert noise.contention(monitor, measuring_from=None) is None and noise.contention(None, 1001.0) is None


def test_nothing_measured_gives_null_figures_and_says_what_was_seen() -> None:
    timeline = Timeline(warmup_steps=5)
    model = torch.nn.Linear(4, 2)
    with Instrumentation(timeline) as inst:
        for _ in range(3):  # evaluation only: forwards, no backward, no optimizer step
            with torch.no_grad():
                model(torch.randn(8, 4))
    report = build_report(timeline, inst).to_json()
    assert report["verdict"] is None and report["data_wait_fraction"] is None and report["fractions"] is None
    assert report["samples_per_s"] is None and report["steps_measured"] == 0
    assert "no training step was seen" in report["verdict_reason"] and "0 backward pass(es)" in report["verdict_reason"]
