"""The report from a `Capture` alone (records/capture.py): evidence, verdict, fixes and notes, pure functions of it."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from trainfast.diagnose.evidence import monitored, noise
from trainfast.diagnose.evidence.evidence import Evidence, _device_busy, compute_of, evidence_of
from trainfast.diagnose.evidence.wholerun import account
from trainfast.diagnose.fixes.notes import not_offered, why_no_input_fix
from trainfast.diagnose.fixes.rank import recommend
from trainfast.diagnose.fixes.run import whole_run_fixes
from trainfast.diagnose.records.capture import Capture
from trainfast.diagnose.records.steps import main_loader
from trainfast.diagnose.report.report import Report
from trainfast.diagnose.verdict import DATA_WAIT_BOUND, classify, precision_may_pay, with_peak


def whole_entry(capture: Capture) -> dict[str, Any] | None:
    """The report's `whole_run` entry (wholerun.py), with the evaluation's trial and the progress lost to restarts."""
    whole = capture.whole
    if whole is None:
        return None
    entry = account(whole.ledger, end=whole.end, compiled=whole.compiled, warmup=whole.warmup)  # type: ignore[arg-type]
    if whole.trial is not None:
        entry["evaluation"]["trial"] = whole.trial.to_json()
    entry["lost_progress"] = whole.lost_progress
    return entry


def build(capture: Capture) -> Report:
    """Fractions, a verdict, ranked fixes and the notes that qualify them, from what the run captured."""
    t, o = capture.timeline, capture.observed
    records = list(t.records)
    notes = list(capture.notes)
    evidence = evidence_of(capture)
    device = evidence.device
    monitor = capture.monitor
    gpu_util, gpu_util_devices = monitored.gpu_util(monitor, t,  # type: ignore[arg-type]
                                                    o.device_index if device == "cuda" else None)
    device_busy = _device_busy(capture)
    if gpu_util is None and device_busy is not None:  # without NVML, CUDA events say how busy the GPU was
        gpu_util = 100 * device_busy
    fractions = evidence.fractions
    intervals = noise.intervals(records)
    verdict = classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=capture.loader_headroom,
                       intervals=intervals, loader_fed=t.input_source != "script") if records else None
    compute = compute_of(capture)
    if verdict is not None:
        verdict = with_peak(verdict, compute, device, precision_hint=precision_may_pay(evidence))
        if verdict.name == "input-bound" and evidence.workers is not None and t.input_source != "script":
            verdict = replace(verdict, reason=f"{verdict.reason}; {evidence.workers.phrase()}")
        evidence = replace(evidence, verdict=verdict.name)
    if t.evaluation_steps:
        how = ("batches fetched with gradients off" if t.loader_fed else
               "the model called with gradients off before the step's training forward")
        notes.append(f"{t.evaluation_steps} step(s) that spanned an evaluation pass ({how}, the model in eval "
                     "mode) were left out of the step's split; their time counts in samples/s, which is over the "
                     "measured window's wall time")
    if t.cycle is not None:
        span = ("spans whole cycles, from one collection phase to the next" if t.cycle == "whole" else
                "ends mid-cycle: a cycle is longer than the steps measured allow; measure more (--steps) for the "
                "cycle's true rate")
        notes.append("the loop collects between updates (no-grad forwards in training mode before some steps' "
                     f"update: an RL rollout, sampling): that phase is booked as its own share, and the measured "
                     f"window {span}")
    if t.input_source == "script":
        notes.append("no DataLoader fed training: data wait is the time from the end of one step to the model's "
                     "first forward (input prepared in the loop), and samples are counted from the model's input")
    spread = noise.spread(records)
    contention = noise.contention(monitor, t.measure_started_monotonic,  # type: ignore[arg-type]
                                  cores_fallback=capture.machine.logical_cpus)
    loader = main_loader(evidence.loaders)
    notes.extend(noise.noise_notes(spread, contention, waiting_workers=evidence.workers is not None
                                   and evidence.workers.wait and fractions.data_wait > DATA_WAIT_BOUND,
                                   periodic=evidence.periodic, restarted_workers=loader.num_workers if loader
                                   and not (loader.persistent_workers or loader.thread_backed) else 0))
    recommendations = recommend(evidence) if records else []
    notes.extend(not_offered(evidence))
    probe = evidence.thread_probe
    if (probe is not None and probe[0] < evidence.threads and probe[1] > 1
            and not any(r.id == "num_workers" for r in recommendations)):
        notes.append(f"more loader workers would not pay here: the model step took {probe[1]:.2f}x as long with "
                     f"{probe[0]} intra-op thread(s), the count that would leave cores for them (measured)")
    elif (unaddressed := why_no_input_fix(evidence, recommendations)) is not None:
        notes.append(unaddressed)
    whole = whole_entry(capture)
    if whole is not None:
        assert capture.whole is not None
        recommendations, run_notes = whole_run_fixes(
            whole, recommendations, trial=capture.whole.trial, loaders=list(capture.loaders),
            step_wait_s=statistics.median(r.wait_s for r in records) if records else None,
            bandwidth=capture.whole.bandwidth)
        notes.extend(run_notes)
    if records and evidence.samples_per_s is None:
        notes.append("samples/s unknown: no tensor with a batch dimension was found in the batches (tuples, lists, "
                     "dicts and dataclasses are searched); the step times stand")
    return Report(
        verdict=verdict, fractions=fractions if records else None, steps=records, warmup_steps=t.warmup_steps,
        samples_per_s=evidence.samples_per_s, step_s=evidence.step_s if records else None,
        loaders=list(capture.loaders), recommendations=recommendations,
        observed=_observed_json(evidence, capture, gpu_util=gpu_util, gpu_util_devices=gpu_util_devices,
                                device_busy=device_busy),
        env=capture.env or {}, monitor=monitored.monitor_json(monitor),  # type: ignore[arg-type]
        script=capture.script or {}, notes=notes,
        step_signal=t.signal, input_source=t.input_source, seen=t.seen(),
        step_spread=spread, intervals={k: list(v) for k, v in intervals.items()} if intervals else None,
        contention=contention, oom=capture.oom, compute=compute, whole_run=whole)


def _observed_json(evidence: Evidence, capture: Capture, *, gpu_util: float | None,
                   gpu_util_devices: list[str], device_busy: float | None) -> dict[str, Any]:
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
        "cudnn_benchmark": evidence.cudnn_benchmark, "gpu_util_mean": gpu_util,
        "gpu_util_devices": gpu_util_devices, "device_busy_fraction": device_busy,
        "jpeg_decoded_pixels_median": evidence.jpeg_decoded_pixels,
        "thread_probe": {"threads": probe[0], "compute_slowdown": probe[1]} if probe else None,
        "trials": evidence.trials.to_json() if evidence.trials is not None else None,
        "workers": evidence.workers.to_json() if evidence.workers is not None else None,
        "collectives": evidence.collectives,
        "epoch_starts": list(evidence.epoch_starts),
        "periodic": evidence.periodic.to_json() if evidence.periodic is not None else None,
    }
