"""The report from a run's `Capture` alone (records/capture.py), each stage in turn: the evidence (evidence/), the
verdict (verdict.py), the fixes (fixes/), and the notes that qualify them, in the order a reader needs them: what the
measurement left out, how far its figures can be trusted, what the fixes could not offer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from trainfast.diagnose.evidence import monitored, noise
from trainfast.diagnose.evidence.evidence import Evidence, evidence_of
from trainfast.diagnose.evidence.notes import measurement_notes, uncounted_samples
from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.fixes.notes import not_offered, not_offered_on_the_run, unaddressed_input
from trainfast.diagnose.fixes.run import run_fixes
from trainfast.diagnose.records.capture import Capture
from trainfast.diagnose.records.findings import Note
from trainfast.diagnose.records.steps import main_loader
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, verdict_of


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
