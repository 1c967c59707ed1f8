"""The doctor's report: the data of one diagnosis (verdict, figures, fixes), as JSON.

build.py assembles it from a run's capture; the display stage (show/) draws it: `render()` in the terminal, with
the renderer show/terminal.py registers (this stage comes before the display and imports nothing of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from trainfast.diagnose.records.findings import Note, Recommendation, Verdict
from trainfast.diagnose.records.steps import Fractions, LoaderStats, StepRecord, max_speedups
from trainfast.diagnose.verdict import no_verdict_reason

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class Report:
    verdict: Verdict | None  # None when no step was measured: nothing honest to say
    fractions: Fractions | None  # None when no step was measured
    steps: list[StepRecord]
    warmup_steps: int
    samples_per_s: float | None
    step_s: float | None  # median
    loaders: list[LoaderStats]
    recommendations: list[Recommendation]
    observed: dict[str, Any]
    env: dict[str, Any] = field(default_factory=dict)
    monitor: dict[str, Any] = field(default_factory=dict)
    script: dict[str, Any] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    verify: dict[str, Any] | None = None  # `--verify`: each fix re-run in a fresh process, with the baseline
    step_signal: str | None = None  # what defined a step: "optimizer", "backward" or "explicit" (timeline.py)
    input_source: str | None = None  # "loader" or "script" (no DataLoader)
    seen: dict[str, int] = field(default_factory=dict)  # batches, forwards, backwards, optimizer steps
    step_spread: dict[str, float] | None = None  # p10 / p50 / p90 of the measured steps' seconds
    intervals: dict[str, list[float]] | None = None  # 95 % bootstrap interval of each part's share
    contention: dict[str, Any] | None = None  # other processes' CPU use while measuring
    oom: dict[str, Any] | None = None  # the script died of an out-of-memory error: where, the allocator, advice
    # how far compute is from the hardware's peak: FLOPs of one counted step, achieved FLOP/s, the peak, MFU
    compute: dict[str, Any] | None = None
    # A job of several ranks (torchrun): rank 0 writes the one report of the job (job.py). A single process:
    # world_size 1, rank 0, ranks and straggler None.
    world_size: int = 1
    rank: int = 0  # the rank whose report this is
    ranks: list[dict[str, Any]] | None = None  # each rank's own figures, in rank order
    straggler: dict[str, Any] | None = None  # {rank, phase, seconds_per_step, share}: the rank the others wait for
    # `doctor --whole-run`: the whole run's phases, goodput, throughput over time and drift (wholerun.py)
    whole_run: dict[str, Any] | None = None

    @property
    def data_wait_fraction(self) -> float | None:
        return self.fractions.data_wait if self.fractions else None

    def to_json(self) -> dict[str, Any]:
        reason = self.verdict.reason if self.verdict else no_verdict_reason(self.seen, self.warmup_steps)
        return {
            "verdict": self.verdict.name if self.verdict else None,
            "verdict_reason": reason,
            "data_wait_fraction": self.data_wait_fraction,
            "fractions": self.fractions.to_json() if self.fractions else None,
            "fractions_interval": self.intervals,
            "max_speedup": max_speedups(self.fractions) if self.fractions else None,
            "step_signal": self.step_signal,
            "input_source": self.input_source,
            "seen": self.seen,
            "steps_measured": len(self.steps),
            "warmup_steps": self.warmup_steps,
            "samples_per_s": self.samples_per_s,
            "step_s": self.step_s,
            "step_s_percentiles": self.step_spread,
            "contention": self.contention,
            "loaders": [s.to_json() for s in self.loaders],
            "recommendations": [r.to_json() for r in self.recommendations],
            "observed": self.observed,
            "env": self.env,
            "monitor": self.monitor,
            "script": self.script,
            "oom": self.oom,
            "compute": self.compute,
            "notes": self.notes,
            "verify": self.verify,
            "world_size": self.world_size,
            "rank": self.rank,
            "ranks": self.ranks,
            "straggler": self.straggler,
            "whole_run": self.whole_run,
            "timeline": [{"end_s": r.end_s, "total_s": r.total_s, "wait_s": r.wait_s, "transfer_s": r.transfer_s,
                          "host_s": r.host_s, "collect_s": r.collect_s, "comm_s": r.comm_s, "compute_s": r.compute_s,
                          "samples": r.samples,
                          "syncs": r.syncs}
                         for r in self.steps],
        }

    # the terminal view (show/terminal.py's), set by the package's face, trainfast/diagnose/__init__.py
    renderer: ClassVar[Callable[[dict[str, Any], Console | None], None] | None] = None

    def render(self, console: Console | None = None) -> None:
        """The report in the terminal (show/terminal.py), on `console` or a new one."""
        if Report.renderer is None:
            raise RuntimeError("no terminal renderer: import trainfast.diagnose, which sets show/terminal.py's")
        Report.renderer(self.to_json(), console)
