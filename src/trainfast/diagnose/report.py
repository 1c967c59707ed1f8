"""The doctor's report: assembled from the measurements, written as JSON, shown in the terminal."""

from __future__ import annotations

import statistics
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
from trainfast.diagnose.recommend import Recommendation, num_workers, recommend, why_no_input_fix
from trainfast.diagnose.timeline import StepRecord, Timeline
from trainfast.dynamo import dynamo_counts
from trainfast.host import available_cpus
from trainfast.monitor import Monitor, percentile, sustained_growth_per_minute
from trainfast.monitor.analysis import window_mean
from trainfast.precision.policy import device_caps


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
            "notes": self.notes,
            "verify": self.verify,
            "timeline": [{"end_s": r.end_s, "total_s": r.total_s, "wait_s": r.wait_s, "transfer_s": r.transfer_s,
                          "host_s": r.host_s, "compute_s": r.compute_s, "samples": r.samples, "syncs": r.syncs}
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


# The extra phase: a few steps (after a short warm-up of their own) at the thread count a loader fix would
# leave the model step.
THREADS_PHASE = "threads"
PROBE_WARMUP, PROBE_STEPS = 2, 5
# A spread this wide (p90 over p50) makes per-step figures unreliable: other load, or uneven steps.
NOISY_SPREAD = 2.0
# Other processes busy on this many cores while measuring take time from the script's own.
CONTENTION_CORES = 0.5


def _median_compute(records: list[StepRecord]) -> float:
    return statistics.median(r.compute_s for r in records)


def _evidence(timeline: Timeline, instrumentation: Instrumentation, records: list[StepRecord], *,
              final: bool = False, verdict: str = "", env: dict[str, Any] | None = None,
              monitor: Monitor | None = None,
              loader_headroom: float | None = None, thread_probe: tuple[int, float] | None = None) -> Evidence:
    """What the rules read, from the measured steps and what the hooks observed. `final`: for the report, when
    the figures that synchronise the device (skipped scaler steps, peak memory) may be read."""
    observed = instrumentation.observed
    total = sum(r.total_s for r in records)
    fractions = Fractions.of(total_s=total, wait_s=sum(r.wait_s for r in records),
                             transfer_s=sum(r.transfer_s for r in records), host_s=sum(r.host_s for r in records))
    samples = sum(r.samples for r in records)
    device = _device(observed)
    waits = [r.wait_s for r in records]
    mean_wait = statistics.fmean(waits) if waits else 0.0
    compiled, recompiled, breaks = _compile_counts(observed)
    decoded = float(statistics.median(observed.jpeg_decoded_pixels)) if observed.jpeg_decoded_pixels else None
    return Evidence(
        verdict=verdict, device=device, fractions=fractions,
        step_s=statistics.median(r.total_s for r in records) if records else 0.0, steps=len(records),
        samples_per_s=samples / total if samples and total > 0 else None,
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
        worker_rss_growth_per_min=_worker_rss_growth(monitor, timeline.measure_started_monotonic),
        loader_headroom=loader_headroom, thread_probe=thread_probe, input_source=timeline.input_source)


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


def thread_probe(timeline: Timeline, instrumentation: Instrumentation) -> Callable[[str], None]:
    """A `Timeline.on_phase_end`: when the measured steps are in and the loader fix about to be proposed on the
    CPU would take intra-op threads from the model step, measure a few more steps at that thread count (on 2
    CPUs a compute-heavy step can take 1.8x as long on one thread). The caller restores the thread count."""
    def on_phase_end(phase: str) -> None:
        threads = proposed_threads(timeline, instrumentation) if phase == "measure" else None
        if threads is not None:
            instrumentation.observed.probe_threads = threads
            timeline.add_phase(THREADS_PHASE, warmup=PROBE_WARMUP, steps=PROBE_STEPS)
            torch.set_num_threads(threads)
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
                         loader_headroom=loader_headroom,
                         thread_probe=_thread_probe(timeline, observed.probe_threads, records))
    device = evidence.device
    gpu_util, gpu_util_devices = _gpu_util(monitor, timeline, observed.device_index if device == "cuda" else None)
    device_busy = _device_busy(instrumentation, records)
    if gpu_util is None and device_busy is not None:  # without NVML, CUDA events say how busy the GPU was
        gpu_util = 100 * device_busy
    fractions = evidence.fractions
    intervals = _intervals(records)
    verdict = classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=loader_headroom,
                       intervals=intervals, loader_fed=timeline.input_source != "script") if records else None
    if verdict is not None:
        evidence = replace(evidence, verdict=verdict.name)
    if timeline.evaluation_steps:
        how = ("batches fetched with gradients off" if timeline.loader_fed else
               "the model called with gradients off before the step's training forward")
        notes.append(f"{timeline.evaluation_steps} step(s) that spanned an evaluation pass ({how}) were left out of "
                     "the figures")
    if timeline.input_source == "script":
        notes.append("no DataLoader fed training: data wait is the time from the end of one step to the model's "
                     "first forward (input prepared in the loop), and samples are counted from the model's input")
    spread = _spread(records)
    contention = _contention(monitor, timeline.measure_started_monotonic)
    notes.extend(_noise_notes(spread, contention))
    recommendations = recommend(evidence) if records else []
    probe = evidence.thread_probe
    if probe is not None and not any(r.id == "num_workers" for r in recommendations):
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
        contention=contention, oom=oom)


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
    }


def _thread_probe(timeline: Timeline, threads: int | None, records: list[StepRecord]) -> tuple[int, float] | None:
    probed = timeline.phase_records(THREADS_PHASE)
    if threads is None or not probed or not records or _median_compute(records) <= 0:
        return None
    return threads, _median_compute(probed) / _median_compute(records)


def _intervals(records: list[StepRecord]) -> dict[str, tuple[float, float]] | None:
    if len(records) < 3:
        return None
    totals = [r.total_s for r in records]
    parts = {"data_wait": [r.wait_s for r in records], "transfer": [r.transfer_s for r in records],
             "host": [r.host_s for r in records]}
    return {name: share_interval(values, totals) for name, values in parts.items()}


def _spread(records: list[StepRecord]) -> dict[str, float] | None:
    if not records:
        return None
    seconds = [r.total_s for r in records]
    return {"p10": percentile(seconds, 10), "p50": percentile(seconds, 50), "p90": percentile(seconds, 90)}


def _contention(monitor: Monitor | None, measuring_from: float | None) -> dict[str, Any] | None:
    """Cores other processes kept busy while measuring: all CPUs' busy time less this process and its workers."""
    since = _since_start(monitor, measuring_from)
    if monitor is None or since is None or "cpu.percent" not in monitor.metrics():
        return None
    cores = sum(1 for m in monitor.metrics() if m.startswith("cpu") and m[3:4].isdigit()) or psutil.cpu_count() or 1
    series = {m: dict(zip(*monitor.series(m), strict=True)) for m in ("cpu.percent", "proc.cpu_percent",
                                                                       "workers.cpu_percent")}
    others = [max(0.0, busy * cores - series["proc.cpu_percent"].get(t, 0.0)
                  - series["workers.cpu_percent"].get(t, 0.0)) / 100
              for t, busy in series["cpu.percent"].items() if t >= since]
    if not others:
        return None
    return {"other_cores_busy_mean": statistics.fmean(others), "other_cores_busy_max": max(others), "cores": cores,
            "samples": len(others)}


def _noise_notes(spread: dict[str, float] | None, contention: dict[str, Any] | None) -> list[str]:
    notes = []
    if spread and spread["p50"] > 0 and spread["p90"] > NOISY_SPREAD * spread["p50"]:
        notes.append(f"step times vary widely (p10 {spread['p10'] * 1e3:.1f} ms, p50 {spread['p50'] * 1e3:.1f} ms, "
                     f"p90 {spread['p90'] * 1e3:.1f} ms): the figures are unreliable; measure more steps "
                     "(--steps) on a quieter machine")
    if contention and contention["other_cores_busy_mean"] >= CONTENTION_CORES:
        notes.append(f"other processes kept {contention['other_cores_busy_mean']:.1f} of {contention['cores']} "
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


def _worker_rss_growth(monitor: Monitor | None, measuring_from: float | None) -> float | None:
    """Sustained growth (bytes/min) of the warm workers' resident memory while measuring: copy-on-read."""
    since = _since_start(monitor, measuring_from)
    if monitor is None or since is None or "workers.rss_bytes" not in monitor.metrics():
        return None
    times, values = monitor.series("workers.rss_bytes")
    count_times, counts = monitor.series("workers.count")
    if count_times != times:
        return None
    return sustained_growth_per_minute(times, values, counts, since=since)


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
        title = "fixes, largest measured gain first" if verified else "fixes, largest expected gain first"
        table = Table(title=title, title_justify="left", show_lines=True)
        for column in ("id", "expected", *(("measured",) if verified else ()), "fix"):
            table.add_column(column, overflow="fold")
        for r in report.recommendations:
            expected = f"{r.expected_gain:.2f}x" if r.expected_gain else "?"
            measured = (f"{r.measured_gain:.2f}x" if r.measured_gain is not None else "-",) if verified else ()
            table.add_row(r.id, expected, *measured, f"[bold]{r.title}[/]\nwhy: {r.why}\nfix: [cyan]{r.fix}[/]")
        console.print(table)
    elif report.verdict is not None:
        console.print("no fix to recommend from what was measured")
    for check in report.env.get("checks", []):
        if check.get("status") in ("warn", "fail"):
            console.print(f"[yellow]{check['status']}[/] {check['name']}: {check['detail']} — {check.get('fix', '')}")
    for note in report.notes:
        console.print(f"note: {note}")


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
             ("compute", f.compute, "green")]
    bar = "".join(f"[{color}]{'█' * round(share * width)}[/]" for _, share, color in parts)
    legend = "  ".join(f"[{color}]■[/] {name} {share:.0%}" for name, share, color in parts)
    return f"{bar}\n{legend}"
