"""The doctor's report (`Report`: the data of one diagnosis, `to_json()` the one representation every display
reads) and how it is made (`build`): from a run's `Capture` alone (records/capture.py), each stage in turn: the
evidence (evidence/), the verdict (verdict.py), the fixes (fixes/), and the notes that qualify them, in the order a
reader needs them: what the measurement left out, how far its figures can be trusted, what the fixes could not
offer. The display stage (show/) draws it: `render()` in the terminal, with the renderer the package's face sets
(this stage comes before the display and imports nothing of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from trainfast.diagnose.evidence import monitored, noise
from trainfast.diagnose.evidence.evidence import Evidence, evidence_of
from trainfast.diagnose.evidence.notes import measurement_notes, uncounted_samples
from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.fixes.notes import not_offered, not_offered_on_the_run, unaddressed_input
from trainfast.diagnose.fixes.run import run_fixes
from trainfast.diagnose.fixes.where import locate
from trainfast.diagnose.records.capture import Capture
from trainfast.diagnose.records.findings import Note, Recommendation, Verdict
from trainfast.diagnose.records.steps import Fractions, LoaderStats, StepRecord, main_loader, max_speedups
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, no_verdict_reason, verdict_of

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


def build(capture: Capture) -> Report:
    """Fractions, a verdict, ranked fixes and the notes that qualify them, from what the run captured."""
    t = capture.timeline
    records = list(t.records)
    evidence = evidence_of(capture)
    verdict = verdict_of(evidence)
    if verdict is not None:
        evidence = replace(evidence, verdict=verdict.name)
    spread = noise.spread(records)
    contention = noise.contention(capture.monitor, t.measure_started_monotonic,
                                  cores_fallback=capture.machine.logical_cpus)
    loader = main_loader(evidence.loaders)
    notes = [Note(n, "measurement") for n in capture.notes] + measurement_notes(t)
    notes += noise.noise_notes(spread, contention, waiting_workers=evidence.workers is not None
                               and evidence.workers.wait and evidence.fractions.data_wait > DATA_WAIT_BOUND,
                               periodic=evidence.periodic, restarted_workers=loader.num_workers if loader
                               and not (loader.persistent_workers or loader.thread_backed) else 0)
    recommendations = recommend(evidence) if records else []
    notes += not_offered(evidence)
    if (unaddressed := unaddressed_input(evidence, recommendations)) is not None:
        notes.append(unaddressed)
    if evidence.run is not None:
        recommendations = run_fixes(evidence, evidence.run, recommendations)
        notes += not_offered_on_the_run(evidence)
    recommendations = locate(recommendations, evidence, capture.sites)
    notes += uncounted_samples(t)
    return Report(
        verdict=verdict, fractions=evidence.fractions if records else None, steps=records,
        warmup_steps=t.warmup_steps, samples_per_s=evidence.samples_per_s,
        step_s=evidence.step_s if records else None, loaders=list(capture.loaders),
        recommendations=recommendations, observed=_observed_json(evidence, capture), env=capture.env or {},
        monitor=monitored.monitor_json(capture.monitor), script=capture.script or {}, notes=notes,
        step_signal=t.signal, input_source=t.input_source, seen=t.seen(), step_spread=spread,
        intervals={k: list(v) for k, v in evidence.intervals.items()} if evidence.intervals else None,
        contention=contention, oom=capture.oom, compute=dict(evidence.compute) if evidence.compute else None,
        whole_run=dict(evidence.run.entry) if evidence.run is not None else None)


def _observed_json(evidence: Evidence, capture: Capture) -> dict[str, Any]:
    """The report's "observed" entry: the figures the rules read, as `evidence` holds them, with what the hooks
    saw that no rule reads (the device index, the parameter count, the thread count training started with) and
    how busy the GPU was."""
    probe = evidence.thread_probe
    o = capture.observed
    return {
        "device": evidence.device, "device_index": o.device_index, "threads": o.threads_seen,
        "parameters": o.parameters, "autocast": list(evidence.autocast), "compiled": evidence.compiled,
        "recompiled_frames": evidence.recompiled_frames, "graph_breaks": evidence.graph_breaks,
        "scaler_steps": evidence.scaler_steps, "scaler_skipped_steps": evidence.scaler_skipped_steps,
        "syncs_per_step": evidence.syncs_per_step, "conv_weights": evidence.conv_weights,
        "conv_weights_channels_last": evidence.conv_weights_channels_last,
        "conv_weights_ambiguous": evidence.conv_weights_ambiguous, "input_layout": evidence.input_layout,
        "cudnn_benchmark": evidence.cudnn_benchmark, "gpu_util_mean": evidence.gpu_util,
        "gpu_util_devices": list(evidence.gpu_util_devices), "device_busy_fraction": evidence.device_busy,
        "jpeg_decoded_pixels_median": evidence.jpeg_decoded_pixels,
        "thread_probe": {"threads": probe[0], "compute_slowdown": probe[1]} if probe else None,
        "trials": evidence.trials.to_json() if evidence.trials is not None else None,
        "workers": evidence.workers.to_json() if evidence.workers is not None else None,
        "collectives": o.collectives,
        "epoch_starts": list(evidence.epoch_starts),
        "periodic": evidence.periodic.to_json() if evidence.periodic is not None else None,
    }
