"""The doctor's report built from a run's measurements: fractions, a verdict, ranked fixes and the notes that
qualify them (report.py holds the result)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import torch

from trainfast.diagnose import measured, monitored, noise
from trainfast.diagnose.classify import DATA_WAIT_BOUND, classify
from trainfast.diagnose.evidence import Evidence, main_loader
from trainfast.diagnose.input_fixes import why_no_input_fix
from trainfast.diagnose.instrument import Instrumentation, Observations
from trainfast.diagnose.mfu import compute_entry, with_peak
from trainfast.diagnose.recommend import not_offered, precision_may_pay, recommend
from trainfast.diagnose.report import Report
from trainfast.diagnose.runfixes import WholeRun, whole_run_fixes
from trainfast.diagnose.timeline import Timeline
from trainfast.monitor import Monitor


def build_report(timeline: Timeline, instrumentation: Instrumentation, *, monitor: Monitor | None = None,
                 env: dict[str, Any] | None = None, script: dict[str, Any] | None = None,
                 loader_headroom: float | None = None, notes: list[str] | None = None,
                 oom: dict[str, Any] | None = None, whole: WholeRun | None = None) -> Report:
    """Turn what the hooks recorded into fractions, a verdict and ranked fixes (the only device sync). `oom`: the
    runner's entry for a script that died of an out-of-memory error; the measured steps before it still count.
    `whole`: a whole run's accounting (runfixes.py): its section, and every fix ranked by its gain on the run."""
    timeline.finish()
    observed = instrumentation.observed
    if measured.device_of(observed) == "cuda":
        torch.cuda.synchronize(observed.device_index)
    # the copies' own device time replaces the host time they blocked (which includes waiting for queued kernels)
    timeline.correct_transfers(instrumentation.device_timer.seconds)
    records = list(timeline.records)
    notes = list(notes or [])
    evidence = measured.evidence_of(timeline, instrumentation, records, final=True, env=env, monitor=monitor,
                                    loader_headroom=loader_headroom)
    device = evidence.device
    gpu_util, gpu_util_devices = monitored.gpu_util(monitor, timeline,
                                                    observed.device_index if device == "cuda" else None)
    device_busy = measured.device_busy(instrumentation, records)
    if gpu_util is None and device_busy is not None:  # without NVML, CUDA events say how busy the GPU was
        gpu_util = 100 * device_busy
    fractions = evidence.fractions
    intervals = noise.intervals(records)
    verdict = classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=loader_headroom,
                       intervals=intervals, loader_fed=timeline.input_source != "script") if records else None
    compute = compute_entry(instrumentation, records)
    if verdict is not None:
        verdict = with_peak(verdict, compute, device, precision_hint=precision_may_pay(evidence))
        if verdict.name == "input-bound" and evidence.workers is not None and timeline.input_source != "script":
            verdict = replace(verdict, reason=f"{verdict.reason}; {evidence.workers.phrase()}")
        evidence = replace(evidence, verdict=verdict.name)
    if timeline.evaluation_steps:
        how = ("batches fetched with gradients off" if timeline.loader_fed else
               "the model called with gradients off before the step's training forward")
        notes.append(f"{timeline.evaluation_steps} step(s) that spanned an evaluation pass ({how}, the model in eval "
                     "mode) were left out of the step's split; their time counts in samples/s, which is over the "
                     "measured window's wall time")
    if timeline.cycle is not None:
        span = ("spans whole cycles, from one collection phase to the next" if timeline.cycle == "whole" else
                "ends mid-cycle: a cycle is longer than the steps measured allow; measure more (--steps) for the "
                "cycle's true rate")
        notes.append("the loop collects between updates (no-grad forwards in training mode before some steps' "
                     f"update: an RL rollout, sampling): that phase is booked as its own share, and the measured "
                     f"window {span}")
    if timeline.input_source == "script":
        notes.append("no DataLoader fed training: data wait is the time from the end of one step to the model's "
                     "first forward (input prepared in the loop), and samples are counted from the model's input")
    spread = noise.spread(records)
    contention = noise.contention(monitor, timeline.measure_started_monotonic)
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
    if whole is not None:
        recommendations, run_notes = whole_run_fixes(
            whole.entry, recommendations, trial=whole.trial, loaders=list(instrumentation.loaders),
            step_wait_s=statistics.median(r.wait_s for r in records) if records else None, bandwidth=whole.bandwidth)
        notes.extend(run_notes)
    if records and evidence.samples_per_s is None:
        notes.append("samples/s unknown: no tensor with a batch dimension was found in the batches (tuples, lists, "
                     "dicts and dataclasses are searched); the step times stand")
    return Report(
        verdict=verdict, fractions=fractions if records else None, steps=records, warmup_steps=timeline.warmup_steps,
        samples_per_s=evidence.samples_per_s, step_s=evidence.step_s if records else None,
        loaders=list(instrumentation.loaders), recommendations=recommendations,
        observed=_observed_json(evidence, observed, gpu_util=gpu_util, gpu_util_devices=gpu_util_devices,
                                device_busy=device_busy),
        env=env or {}, monitor=monitored.monitor_json(monitor), script=script or {}, notes=notes,
        step_signal=timeline.signal, input_source=timeline.input_source, seen=timeline.seen(),
        step_spread=spread, intervals={k: list(v) for k, v in intervals.items()} if intervals else None,
        contention=contention, oom=oom, compute=compute, whole_run=whole.entry if whole is not None else None)


def _observed_json(evidence: Evidence, observed: Observations, *, gpu_util: float | None,
                   gpu_util_devices: list[str], device_busy: float | None) -> dict[str, Any]:
    """The report's "observed" entry: the figures the rules read, as `evidence` holds them, with what the hooks
    saw that no rule reads (the device index, the parameter count, the thread count training started with) and
    how busy the GPU was."""
    probe = evidence.thread_probe
    return {
        "device": evidence.device, "device_index": observed.device_index, "threads": observed.threads,
        "parameters": observed.parameters, "autocast": list(evidence.autocast), "compiled": evidence.compiled,
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
