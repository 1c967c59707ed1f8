"""The doctor's report: assembled from the measurements, written as JSON, shown in the terminal."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainfast.diagnose.classify import Fractions, Verdict, classify, max_speedups, share_interval
from trainfast.diagnose.evidence import Evidence, LoaderStats
from trainfast.diagnose.instrument import Instrumentation, Observations
from trainfast.diagnose.probe import BUDGET_SHARE, MAX_PROBE_S, Trials, candidates, run_trials
from trainfast.diagnose.recommend import Recommendation, not_offered, num_workers, recommend, why_no_input_fix
from trainfast.diagnose.timeline import MEASURE, StepRecord, Timeline
from trainfast.dynamo import dynamo_counts
from trainfast.flops import FlopCounter, peak_flops, utilisation
from trainfast.host import available_cpus
from trainfast.monitor import Monitor, percentile, sustained_growth_per_minute
from trainfast.monitor.analysis import window_mean
from trainfast.precision.policy import device_caps
from trainfast.trainer.settings import torch_settings


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
    notes: list[str] = field(default_factory=list)
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
    # A job of several ranks (torchrun): rank 0 writes the one report of the job (ranks.py). A single process:
    # world_size 1, rank 0, ranks and straggler None.
    world_size: int = 1
    rank: int = 0  # the rank whose report this is
    ranks: list[dict[str, Any]] | None = None  # each rank's own figures, in rank order
    straggler: dict[str, Any] | None = None  # {rank, phase, seconds_per_step, share}: the rank the others wait for

    @property
    def data_wait_fraction(self) -> float | None:
        return self.fractions.data_wait if self.fractions else None

    def to_json(self) -> dict[str, Any]:
        reason = self.verdict.reason if self.verdict else _no_verdict_reason(self.seen, self.warmup_steps)
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
            "timeline": [{"end_s": r.end_s, "total_s": r.total_s, "wait_s": r.wait_s, "transfer_s": r.transfer_s,
                          "host_s": r.host_s, "collect_s": r.collect_s, "compute_s": r.compute_s, "samples": r.samples,
                          "syncs": r.syncs}
                         for r in self.steps],
        }

    def render(self, console: Console | None = None) -> None:
        render_terminal(self, console or Console())


def _no_verdict_reason(seen: dict[str, int], warmup: int) -> str:
    """What was seen when no step was measured, and what to do."""
    if not seen:
        return "no training step was measured"
    counts = (f"{seen.get('batches', 0)} batch(es) fetched, {seen.get('forwards', 0)} model forward(s), "
              f"{seen.get('backwards', 0)} backward pass(es), {seen.get('optimizer_steps', 0)} optimizer step(s)")
    if not seen.get("backwards") and not seen.get("optimizer_steps"):
        return (f"no training step was seen: {counts}. A step is an optimizer.step() or, without an optimizer, a "
                "backward pass (loss.backward() or torch.autograd.backward): is the script training (not only "
                "evaluating), and does it reach its loop before --max-seconds? Gradients taken with torch.func "
                "(grad, vmap) or torch.autograd.grad, with no optimizer, are not seen as steps")
    return (f"fewer than {warmup + 1} steps ran (warm-up {warmup}): {counts}. Lower --warmup, raise --max-seconds, "
            "or give the script more steps")


# A spread this wide (p90 over p50) makes per-step figures unreliable: other load, or uneven steps.
NOISY_SPREAD = 2.0
# Other processes busy on this many cores while measuring take time from the script's own.
CONTENTION_CORES = 0.5


def _evidence(timeline: Timeline, instrumentation: Instrumentation, records: list[StepRecord], *,
              final: bool = False, verdict: str = "", env: dict[str, Any] | None = None,
              monitor: Monitor | None = None,
              loader_headroom: float | None = None) -> Evidence:
    """What the rules read, from the measured steps and what the hooks observed. `final`: for the report, when
    the figures that synchronise the device (skipped scaler steps, peak memory) may be read."""
    observed = instrumentation.observed
    total = sum(r.total_s for r in records)
    fractions = Fractions.of(total_s=total, wait_s=sum(r.wait_s for r in records),
                             transfer_s=sum(r.transfer_s for r in records), host_s=sum(r.host_s for r in records),
                             collect_s=sum(r.collect_s for r in records))
    device = _device(observed)
    waits = [r.wait_s for r in records]
    mean_wait = statistics.fmean(waits) if waits else 0.0
    compiled, recompiled, breaks = _compile_counts(observed)
    decoded = float(statistics.median(observed.jpeg_decoded_pixels)) if observed.jpeg_decoded_pixels else None
    return Evidence(
        verdict=verdict, device=device, fractions=fractions,
        step_s=statistics.median(r.total_s for r in records) if records else 0.0, steps=len(records),
        samples_per_s=timeline.samples_per_s,
        syncs_per_step=statistics.fmean(r.syncs for r in records) if records else 0.0, cpus=available_cpus(),
        threads=observed.threads or torch.get_num_threads(), loaders=tuple(instrumentation.loaders),
        shm_bytes=(env or {}).get("shm_bytes"), autocast=tuple(sorted(observed.autocast)),
        scaler_steps=observed.scaler_steps, scaler_skipped_steps=observed.scaler_skipped() if final else 0,
        bf16_supported=_bf16_native(device, observed.device_index),
        compiled=compiled, recompiled_frames=recompiled, graph_breaks=breaks, conv_weights=observed.conv_weights,
        conv_weights_channels_last=observed.conv_weights_channels_last,
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        gpu_memory_fraction=_gpu_memory_fraction(device, observed.device_index) if final else None,
        jpeg_decoded_pixels=decoded,
        wait_spike_ratio=percentile(waits, 95) / mean_wait if mean_wait > 0 else None,
        worker_private_growth_per_min=_worker_private_growth(monitor, timeline.measure_started_monotonic),
        loader_headroom=loader_headroom, thread_probe=_thread_probe(instrumentation.observed.trials),
        input_source=timeline.input_source,
        compute_s=statistics.median(r.compute_s for r in records) if records else 0.0,
        trials=observed.trials, parameter_dtypes=frozenset(observed.parameter_dtypes), cycle=timeline.cycle)


def _device(observed: Observations) -> str:
    """The model's device type; without a model seen, "cuda" only if the process did CUDA work (asking the
    device anything on a CPU-only run would create a CUDA context)."""
    return observed.device or ("cuda" if torch.cuda.is_initialized() else "cpu")


def _compile_counts(observed: Observations) -> tuple[bool, int, int]:
    """(compiled, frames recompiled, graph breaks) of this run: torch._dynamo's counters are process-wide, so
    the loop compiled if frames were compiled since instrumentation started (or its model is compiled, cached
    from before); recompiles are what the measured steps added (warm-up end to their end), graph breaks what
    this loop's compilation found (a break, usually found in warm-up, costs eager time at every step)."""
    now = dynamo_counts()
    start = observed.dynamo_at_start or now
    warm, end = observed.dynamo_at_warmup or now, observed.dynamo_at_end or now
    compiled = observed.compiled_model or now["frames"] > start["frames"]
    return (compiled, max(0, end["frames"] - warm["frames"]), max(0, end["graph_breaks"] - start["graph_breaks"]))


def _bf16_native(device: str, index: int | None) -> bool:
    """bf16 runs natively on the model's GPU (compute capability 8.0, Ampere, and later; the current device may
    be another one) or on this CPU (AMX, AVX512-BF16, ARM BF16)."""
    if device == "cpu":
        return device_caps(torch.device("cpu")).bf16
    return device == "cuda" and torch.cuda.get_device_capability(index) >= (8, 0)


# One step after the measured ones, its FLOPs counted (FlopCounterMode slows it: it is not among the measured)
FLOPS_PHASE = "flops"


def gain_probe(timeline: Timeline, instrumentation: Instrumentation) -> Callable[[str], None]:
    """A `Timeline.on_phase_end`: when the measured steps end, time the candidate fixes on the script's own model
    and first training input (probe.py), within `BUDGET_SHARE` of the budget left (the timeline's deadline) and
    `MAX_PROBE_S` (the time is the doctor's, not the script's: `Timeline.pause`); then count the FLOPs of the next
    step, whole, as the script runs it. Not for a compiled model: it would recompile under the counting mode. Every
    rank of a job decides alike (on whether the model is compiled, not on a timing), so all take the same steps."""
    def on_phase_end(phase: str) -> None:
        if phase == FLOPS_PHASE and instrumentation.observed.flop_counter is not None:
            instrumentation.observed.flops_per_step = instrumentation.observed.flop_counter.stop()
            instrumentation.observed.flop_counter = None
            return
        if phase != MEASURE or instrumentation.observed.trials is not None:
            return
        _time_candidates()
        if instrumentation.observed.compiled_model or instrumentation.observed.dynamo_at_end.get("frames", 0) > \
                instrumentation.observed.dynamo_at_start.get("frames", 0):
            instrumentation.observed.flops_reason = "the model is compiled: counting would make torch.compile recompile"
            return
        timeline.add_phase(FLOPS_PHASE, warmup=0, steps=1)
        instrumentation.observed.flop_counter = FlopCounter().start()

    def _time_candidates() -> None:
        calls = list(instrumentation.last_calls.values())
        if not calls:
            instrumentation.observed.trials = Trials(reason="no training forward of a model was seen")
            return
        started = time.perf_counter()
        left = MAX_PROBE_S if timeline.deadline is None else max(0.0, timeline.deadline - started)
        observed = instrumentation.observed
        index = observed.device_index
        device = torch.device(_device(observed)) if index is None else torch.device(_device(observed), index)
        threads = torch.get_num_threads()  # the script's, now
        counts = {available_cpus()} | ({fewer} if (fewer := proposed_threads(timeline, instrumentation)) else set())
        tried, skipped = candidates(device=device, autocast=tuple(sorted(observed.autocast)),
                                    parameter_dtypes=observed.parameter_dtypes,
                                    bf16_native=_bf16_native(device.type, observed.device_index),
                                    nchw_convs=observed.conv_weights - observed.conv_weights_channels_last,
                                    threads=threads, thread_counts=tuple(sorted(counts)))
        instrumentation.paused = True
        try:
            with torch_settings():  # (a candidate's thread count is put back)
                trials = run_trials(calls, tried, base_autocast=tuple(observed.autocast),
                                    budget_s=min(MAX_PROBE_S, BUDGET_SHARE * left))
        finally:
            instrumentation.paused = False
            timeline.pause(time.perf_counter() - started)
        trials.trials = skipped | trials.trials
        instrumentation.observed.trials = trials
    return on_phase_end


def proposed_threads(timeline: Timeline, instrumentation: Instrumentation) -> int | None:
    """The intra-op thread count the num_workers fix would propose on the CPU, if below the current one."""
    records = timeline.records
    if not records:
        return None
    evidence = _evidence(timeline, instrumentation, records)
    fix = num_workers(evidence) if evidence.device == "cpu" else None
    threads = (fix.overrides or {}).get("threads") if fix is not None else None
    if threads is None or threads >= evidence.threads:
        return None
    return int(threads)


def build_report(timeline: Timeline, instrumentation: Instrumentation, *, monitor: Monitor | None = None,
                 env: dict[str, Any] | None = None, script: dict[str, Any] | None = None,
                 loader_headroom: float | None = None, notes: list[str] | None = None,
                 oom: dict[str, Any] | None = None) -> Report:
    """Turn what the hooks recorded into fractions, a verdict and ranked fixes (the only device sync). `oom`: the
    runner's entry for a script that died of an out-of-memory error; the measured steps before it still count."""
    timeline.finish()
    observed = instrumentation.observed
    if _device(observed) == "cuda":
        torch.cuda.synchronize(observed.device_index)
    # the copies' own device time replaces the host time they blocked (which includes waiting for queued kernels)
    timeline.correct_transfers(instrumentation.device_timer.seconds)
    records = list(timeline.records)
    notes = list(notes or [])
    evidence = _evidence(timeline, instrumentation, records, final=True, env=env, monitor=monitor,
                         loader_headroom=loader_headroom)
    device = evidence.device
    gpu_util, gpu_util_devices = _gpu_util(monitor, timeline, observed.device_index if device == "cuda" else None)
    device_busy = _device_busy(instrumentation, records)
    if gpu_util is None and device_busy is not None:  # without NVML, CUDA events say how busy the GPU was
        gpu_util = 100 * device_busy
    fractions = evidence.fractions
    intervals = _intervals(records)
    verdict = classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=loader_headroom,
                       intervals=intervals, loader_fed=timeline.input_source != "script") if records else None
    compute = _compute(instrumentation, records)
    if verdict is not None:
        verdict = _with_peak(verdict, compute, device)
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
    spread = _spread(records)
    contention = _contention(monitor, timeline.measure_started_monotonic)
    notes.extend(_noise_notes(spread, contention))
    recommendations = recommend(evidence) if records else []
    notes.extend(not_offered(evidence))
    probe = evidence.thread_probe
    if (probe is not None and probe[0] < evidence.threads and probe[1] > 1
            and not any(r.id == "num_workers" for r in recommendations)):
        notes.append(f"more loader workers would not pay here: the model step took {probe[1]:.2f}x as long with "
                     f"{probe[0]} intra-op thread(s), the count that would leave cores for them (measured)")
    elif (unaddressed := why_no_input_fix(evidence, recommendations)) is not None:
        notes.append(unaddressed)
    if records and evidence.samples_per_s is None:
        notes.append("samples/s unknown: no tensor with a batch dimension was found in the batches (tuples, lists, "
                     "dicts and dataclasses are searched); the step times stand")
    return Report(
        verdict=verdict, fractions=fractions if records else None, steps=records, warmup_steps=timeline.warmup_steps,
        samples_per_s=evidence.samples_per_s, step_s=evidence.step_s if records else None,
        loaders=list(instrumentation.loaders), recommendations=recommendations,
        observed=_observed_json(evidence, observed, gpu_util=gpu_util, gpu_util_devices=gpu_util_devices,
                                device_busy=device_busy),
        env=env or {}, monitor=_monitor_json(monitor), script=script or {}, notes=notes,
        step_signal=timeline.signal, input_source=timeline.input_source, seen=timeline.seen(),
        step_spread=spread, intervals={k: list(v) for k, v in intervals.items()} if intervals else None,
        contention=contention, oom=oom, compute=compute)


# MFU bands for a compute-bound verdict: near the peak only less work helps; far below it the step is made of
# small kernels, launch overhead or the wrong layout/precision, which compile, a larger batch or CUDA graphs fix.
NEAR_PEAK, FAR_BELOW_PEAK = 0.5, 0.2
COUNTED = ("one whole training step after the measured ones, as the script ran it (matmuls, convolutions and "
           "attention at 2 FLOPs per multiply-add; elementwise ops and the optimizer count 0)")


def _compute(instrumentation: Instrumentation, records: list[StepRecord]) -> dict[str, Any] | None:
    """The report's `compute` entry: the counted step's FLOPs over the mean measured step, against the peak at the
    run's precision and thread count (a datasheet's dense figure for a known GPU, else measured: flops.py)."""
    if not records:
        return None
    flops = instrumentation.observed.flops_per_step
    if flops is None:
        return {"flops_per_step": None, "reason": instrumentation.observed.flops_reason or "no step was counted"}
    observed = instrumentation.observed
    kind = _device(observed)
    device = torch.device(kind) if observed.device_index is None else torch.device(kind, observed.device_index)
    autocast = [dtype for where, dtype in sorted(observed.autocast) if where == kind]
    dtype_name = autocast[0] if autocast else next(iter(sorted(observed.parameter_dtypes)), "float32")
    dtype = getattr(torch, dtype_name, torch.float32)
    try:
        peak = peak_flops(device, dtype, threads=observed.threads or None)
    except (RuntimeError, ValueError) as e:  # a dtype without matmuls on this device
        return {"flops_per_step": flops, "reason": f"no peak for {dtype_name} on {device}: {e}"}
    step_s = statistics.fmean(r.total_s for r in records)
    return utilisation(flops, step_s, peak).to_json() | {"covers": COUNTED, "reason": None}


def _with_peak(verdict: Verdict, compute: dict[str, Any] | None, device: str = "cuda") -> Verdict:
    """A compute-bound verdict says how far from the peak the compute runs, which decides the fix."""
    mfu = compute.get("mfu") if compute else None
    if verdict.name != "compute-bound" or mfu is None or compute is None:
        return verdict
    source = "a datasheet's" if str(compute["peak_source"]).startswith("table") else "a measured"
    where = f"model FLOPs utilisation {mfu:.0%} of {source} {compute['peak_precision']} peak"
    if mfu >= NEAR_PEAK:
        advice = ("near the hardware's limit at this precision: only less work (a smaller model, fewer FLOPs per "
                  "sample) or a faster precision helps")
    elif mfu < FAR_BELOW_PEAK:
        graphs = ", CUDA graphs" if device == "cuda" else ""
        advice = ("far below the peak: small kernels, launch overhead, layout or precision hold it back "
                  f"(torch.compile, a larger batch, mixed precision{graphs})")
    else:
        advice = "between the two: both more efficient kernels and less work can help"
    return Verdict(verdict.name, f"{verdict.reason}; {where}: {advice}")


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
        "cudnn_benchmark": evidence.cudnn_benchmark, "gpu_util_mean": gpu_util,
        "gpu_util_devices": gpu_util_devices, "device_busy_fraction": device_busy,
        "jpeg_decoded_pixels_median": evidence.jpeg_decoded_pixels,
        "thread_probe": {"threads": probe[0], "compute_slowdown": probe[1]} if probe else None,
        "trials": evidence.trials.to_json() if evidence.trials is not None else None,
    }


def _thread_probe(trials: Trials | None) -> tuple[int, float] | None:
    """(threads, slowdown) of the fewest-threads count the replay measured, for the loader fix that proposes it."""
    if trials is None:
        return None
    measured = [(int(t.value), t.factor) for key, t in trials.trials.items() if key.startswith("threads:") and t.factor]
    fewest = min(measured, default=None)
    return (fewest[0], 1 / fewest[1]) if fewest is not None else None


def _intervals(records: list[StepRecord]) -> dict[str, tuple[float, float]] | None:
    if len(records) < 3:
        return None
    totals = [r.total_s for r in records]
    parts = {"data_wait": [r.wait_s for r in records], "transfer": [r.transfer_s for r in records],
             "host": [r.host_s for r in records]}  # (not collection: one step a cycle has it, the cycle is the unit)
    return {name: share_interval(values, totals) for name, values in parts.items()}


def _spread(records: list[StepRecord]) -> dict[str, float] | None:
    if not records:
        return None
    seconds = [r.total_s for r in records]
    return {"p10": percentile(seconds, 10), "p50": percentile(seconds, 50), "p90": percentile(seconds, 90)}


def _contention(monitor: Monitor | None, measuring_from: float | None) -> dict[str, Any] | None:
    """Cores other processes kept busy while measuring: all CPUs' busy time less this process and its workers
    (whose own use, over the same samples, is `own_cores_busy_mean`: a job's other ranks take it off theirs)."""
    since = _since_start(monitor, measuring_from)
    if monitor is None or since is None or "cpu.percent" not in monitor.metrics():
        return None
    cores = sum(1 for m in monitor.metrics() if m.startswith("cpu") and m[3:4].isdigit()) or psutil.cpu_count() or 1
    series = {m: dict(zip(*monitor.series(m), strict=True)) for m in ("cpu.percent", "proc.cpu_percent",
                                                                       "workers.cpu_percent")}
    times = [t for t in series["cpu.percent"] if t >= since]
    own = [(series["proc.cpu_percent"].get(t, 0.0) + series["workers.cpu_percent"].get(t, 0.0)) / 100 for t in times]
    others = [max(0.0, series["cpu.percent"][t] * cores / 100 - mine) for t, mine in zip(times, own, strict=True)]
    if not others:
        return None
    return {"other_cores_busy_mean": statistics.fmean(others), "other_cores_busy_max": max(others), "cores": cores,
            "samples": len(others), "own_cores_busy_mean": statistics.fmean(own)}


def _noise_notes(spread: dict[str, float] | None, contention: dict[str, Any] | None) -> list[str]:
    notes = []
    if spread and spread["p50"] > 0 and spread["p90"] > NOISY_SPREAD * spread["p50"]:
        notes.append(f"step times vary widely (p10 {spread['p10'] * 1e3:.1f} ms, p50 {spread['p50'] * 1e3:.1f} ms, "
                     f"p90 {spread['p90'] * 1e3:.1f} ms): the figures are unreliable; measure more steps "
                     "(--steps) on a quieter machine")
    if contention and contention["other_cores_busy_mean"] >= CONTENTION_CORES:
        siblings = contention.get("sibling_cores_busy_mean")
        who = (f"other processes (not counting this job's other ranks here, {siblings:.1f} cores)" if siblings
               else "other processes")
        notes.append(f"{who} kept {contention['other_cores_busy_mean']:.1f} of {contention['cores']} "
                     "cores busy while measuring: the script's figures include that contention")
    return notes


def _gpu_util(monitor: Monitor | None, timeline: Timeline, model_index: int | None) -> tuple[float | None, list[str]]:
    """Mean NVML utilisation (%) of the GPUs this process uses, over the measured steps only, and their NVML names.

    Another GPU of the node, busy or idle, says nothing about this run, nor does the start-up before the
    measured steps (data set indexing, compilation): averaged in, they make a busy GPU look idle, a false
    host-bound verdict. The GPUs used: the model's, and any other this process held tensors on while
    measuring. None when no sample fell in the window or a GPU cannot be matched to NVML's (torch and NVML
    number GPUs differently; see monitor/sources.py)."""
    since = _since_start(monitor, timeline.measure_started_monotonic)
    until = _since_start(monitor, timeline.measure_ended_monotonic)
    if monitor is None or model_index is None or since is None or until is None:
        return None, []

    def mean(metric: str) -> float | None:
        times, values = monitor.series(metric)
        return window_mean(times, values, since, until)
    metrics = set(monitor.metrics())
    used = {model_index} | {int(m[4:].removesuffix(".allocated_bytes")) for m in metrics
                            if m.startswith("cuda") and m.endswith(".allocated_bytes") and (mean(m) or 0) > 0}
    found = [monitor.nvml_index(index) for index in sorted(used)]
    if None in found:
        return None, []
    names = [f"gpu{i}" for i in found]
    known = [m for m in (mean(f"{n}.util") for n in names if f"{n}.util" in metrics) if m is not None]
    return (statistics.fmean(known) if known else None), names


def _device_busy(instrumentation: Instrumentation, records: list[StepRecord]) -> float | None:
    """Share of the measured steps' wall time the GPU spent on their work (CUDA events; None without them)."""
    events = instrumentation.device_timer
    if not events.pairs or not records:
        return None
    device_s = events.step_seconds()
    host_s = sum(r.total_s for r in records[-len(device_s):])
    return min(1.0, sum(device_s) / host_s) if host_s > 0 else None


def _since_start(monitor: Monitor | None, monotonic: float | None) -> float | None:
    """A `time.monotonic()` instant on the monitor's series clock (seconds since it started)."""
    started = monitor.started_at if monitor is not None else None
    return None if monotonic is None or started is None else monotonic - started


def _worker_private_growth(monitor: Monitor | None, measuring_from: float | None) -> float | None:
    """Sustained growth (bytes/min) of the warm workers' private memory while measuring: copy-on-read. Not their
    RSS, which copied pages leave unchanged and restarted workers step up (see monitor.sources.PsutilSource)."""
    since = _since_start(monitor, measuring_from)
    if monitor is None or since is None or "workers.private_bytes" not in monitor.metrics():
        return None
    times, values = monitor.series("workers.private_bytes")  # not in every sample: matched to the others by time
    counts, started = (dict(zip(*monitor.series(m), strict=True)) for m in ("workers.count", "workers.started"))
    if any(t not in counts or t not in started for t in times):
        return None
    return sustained_growth_per_minute(times, values, [counts[t] for t in times], since=since,
                                       started=[started[t] for t in times])


def _gpu_memory_fraction(device: str, index: int | None) -> float | None:
    """Peak memory allocated on the model's GPU (None: the current one) over its total."""
    if device != "cuda":
        return None
    total = torch.cuda.get_device_properties(index).total_memory
    return torch.cuda.max_memory_allocated(index) / total if total else None


def _monitor_json(monitor: Monitor | None) -> dict[str, Any]:
    if monitor is None:
        return {}
    wanted = [m for m in monitor.metrics() if m in ("cpu.percent", "proc.rss_bytes", "workers.cpu_percent",
                                                    "workers.rss_bytes") or m.startswith("gpu")]
    return {"summary": {name: stats.to_json() for name, stats in monitor.summary().items()},
            "series": {name: [list(p) for p in zip(*monitor.series(name), strict=True)] for name in wanted},
            "unavailable": dict(monitor.unavailable),
            "gpu_sawtooth": monitor.gpu_sawtooth()}


VERDICT_STYLE = {"input-bound": "bold red", "transfer-bound": "bold red", "host-bound": "bold yellow",
                 "compute-bound": "bold green", "balanced": "bold cyan"}


def render_terminal(report: Report, console: Console) -> None:
    title = "trainfast doctor" + (f" — {report.script['target']}" if report.script.get("target") else "")
    console.rule(title)
    if report.script.get("outcome"):
        console.print(f"run: {escape(str(report.script['outcome']))}")  # the script's error text: not markup
    if report.oom:
        console.print(f"[bold red]{escape(oom_headline(report.oom))}[/]: "
                      f"{escape(oom_paragraph(report.oom, headline=False))}")
    if report.verdict is None or report.fractions is None:
        console.print(f"[bold]verdict: n/a[/] — {_no_verdict_reason(report.seen, report.warmup_steps)}")
    else:
        style = VERDICT_STYLE.get(report.verdict.name, "bold")
        console.print(f"verdict: [{style}]{report.verdict.name.upper()}[/] — {report.verdict.reason}")
        rate = f"{report.samples_per_s:,.0f} samples/s, " if report.samples_per_s else ""
        spread = report.step_spread or {}
        steps_by = {"optimizer": "a step = one iteration's optimizer step(s)",
                    "backward": "a step = one iteration's backward pass(es), no optimizer seen",
                    "explicit": "steps ended by the caller"}.get(report.step_signal or "", "")
        console.print(f"measured {len(report.steps)} steps after {report.warmup_steps} warm-up ({steps_by}): {rate}"
                      f"step p10/p50/p90 {1e3 * spread.get('p10', 0):.1f}/{1e3 * spread.get('p50', 0):.1f}/"
                      f"{1e3 * spread.get('p90', 0):.1f} ms")
        console.print(_split_bar(report.fractions))
        if report.compute:
            console.print(escape(compute_line(report.compute)))
    if report.loaders:
        table = Table(title="loaders", title_justify="left")
        for column in ("#", "kind", "dataset", "workers", "pin", "persistent", "prefetch", "batches", "wait"):
            table.add_column(column)
        for s in report.loaders:
            table.add_row(str(s.index), s.kind, s.dataset, str(s.num_workers), str(s.pin_memory),
                          str(s.persistent_workers), str(s.prefetch_factor), str(s.batches), f"{s.wait_s:.2f} s")
        console.print(table)
    if report.recommendations:
        verified = report.verify is not None
        title = ("fixes, verified gains first" if verified else "fixes, measured gains first, then estimates")
        table = Table(title=title, title_justify="left", show_lines=True)
        for column in ("id", "expected", *(("verified",) if verified else ()), "fix"):
            table.add_column(column, overflow="fold")
        for r in report.recommendations:
            basis = "measured" if r.gain_basis != "estimate" else "estimate"  # (verified: its own column)
            expected = f"{r.expected_gain:.2f}x\n{basis}" if r.expected_gain else f"?\n{basis}"
            measured = (f"{r.measured_gain:.2f}x" if r.measured_gain is not None else "-",) if verified else ()
            estimate = f"\nan estimate: {r.basis_reason}" if r.gain_basis == "estimate" and r.basis_reason else ""
            table.add_row(r.id, expected, *measured,
                          f"[bold]{r.title}[/]\nwhy: {r.why}{estimate}\nfix: [cyan]{r.fix}[/]")
        console.print(table)
    elif report.verdict is not None:
        console.print("no fix to recommend from what was measured")
    for check in report.env.get("checks", []):
        if check.get("status") in ("warn", "fail"):
            console.print(f"[yellow]{check['status']}[/] {check['name']}: {check['detail']} — {check.get('fix', '')}")
    for note in report.notes:
        console.print(f"note: {note}")


def compute_line(compute: dict[str, Any]) -> str:
    """The `compute` entry in words: FLOPs per step, the rate achieved and how far it is from the peak."""
    flops = compute.get("flops_per_step")
    if flops is None or compute.get("achieved_flops_per_s") is None:
        return f"compute: FLOPs not counted ({compute.get('reason') or 'unknown'})"
    head = (f"compute: {flops / 1e9:,.2f} GFLOP per step, {compute['achieved_flops_per_s'] / 1e9:,.1f} GFLOP/s "
            f"achieved; peak {compute['peak_flops_per_s'] / 1e9:,.0f} GFLOP/s ({compute['peak_source']})")
    if compute.get("mfu") is None:
        return f"{head}; MFU not reported: {compute.get('mfu_error')}"
    return f"{head}: MFU {compute['mfu']:.1%}"


def oom_headline(oom: dict[str, Any]) -> str:
    """Where the script ran out of memory (the `oom` entry's step and device)."""
    step = oom.get("step")
    where = f"at step {step}" if step is not None else "before its first training step"
    return f"the script ran out of memory {where}" + (f" on {oom['device']}" if oom.get("device") else "")


def oom_paragraph(oom: dict[str, Any], *, headline: bool = True) -> str:
    """The `oom` entry in words: where, the error's first line, what the allocator held and what to change."""
    parts = (str(oom.get("message") or "out of memory"), str(oom.get("advice") or ""))
    detail = " ".join(f"{part.rstrip('.')}." for part in parts if part)
    return f"{oom_headline(oom)}: {detail}" if headline else detail


def _split_bar(f: Fractions, width: int = 60) -> str:
    parts = [("data wait", f.data_wait, "red"), ("transfer", f.transfer, "magenta"), ("host", f.host, "yellow"),
             *((("rollout / host work between updates", f.collection, "blue"),) if f.collection else ()),
             ("compute", f.compute, "green")]
    bar = "".join(f"[{color}]{'█' * round(share * width)}[/]" for _, share, color in parts)
    legend = "  ".join(f"[{color}]■[/] {name} {share:.0%}" for name, share, color in parts)
    return f"{bar}\n{legend}"
