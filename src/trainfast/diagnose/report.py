"""The doctor's report: assembled from the measurements, written as JSON, shown in the terminal."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from trainfast.diagnose.classify import Fractions, Verdict, classify
from trainfast.diagnose.evidence import Evidence, LoaderStats
from trainfast.diagnose.instrument import Instrumentation, dynamo_counts
from trainfast.diagnose.recommend import Recommendation, recommend
from trainfast.diagnose.timeline import StepRecord, Timeline
from trainfast.loader.cpus import available_cpus
from trainfast.monitor import growth_per_minute


@dataclass
class Report:
    verdict: Verdict | None  # None when no step was measured: nothing honest to say
    fractions: Fractions
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

    @property
    def data_wait_fraction(self) -> float:
        return self.fractions.data_wait

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.name if self.verdict else None,
            "verdict_reason": self.verdict.reason if self.verdict else "no optimizer step was measured",
            "data_wait_fraction": self.fractions.data_wait,
            "fractions": self.fractions.to_json(),
            "steps_measured": len(self.steps),
            "warmup_steps": self.warmup_steps,
            "samples_per_s": self.samples_per_s,
            "step_s": self.step_s,
            "loaders": [s.to_json() for s in self.loaders],
            "recommendations": [r.to_json() for r in self.recommendations],
            "observed": self.observed,
            "env": self.env,
            "monitor": self.monitor,
            "script": self.script,
            "notes": self.notes,
            "timeline": [{"end_s": r.end_s, "total_s": r.total_s, "wait_s": r.wait_s, "transfer_s": r.transfer_s,
                          "host_s": r.host_s, "compute_s": r.compute_s, "samples": r.samples, "syncs": r.syncs}
                         for r in self.steps],
        }

    def render(self, console: Console | None = None) -> None:
        render_terminal(self, console or Console())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def build_report(timeline: Timeline, instrumentation: Instrumentation, *, monitor: Any = None,
                 env: dict[str, Any] | None = None, script: dict[str, Any] | None = None,
                 loader_headroom: float | None = None, notes: list[str] | None = None) -> Report:
    """Turn what the hooks recorded into fractions, a verdict and ranked fixes (the only device sync)."""
    records = list(timeline.records)
    observed = instrumentation.observed
    notes = list(notes or [])
    total = sum(r.total_s for r in records)
    fractions = Fractions.of(total_s=total, wait_s=sum(r.wait_s for r in records),
                             transfer_s=sum(r.transfer_s for r in records), host_s=sum(r.host_s for r in records))
    samples = sum(r.samples for r in records)
    device = observed.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.cuda.synchronize()
    gpu_util = _gpu_util(monitor)
    device_busy = _device_busy(instrumentation, records)
    if gpu_util is None and device_busy is not None:  # without NVML, CUDA events say how busy the GPU was
        gpu_util = 100 * device_busy
    verdict = classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=loader_headroom) \
        if records else None
    waits = [r.wait_s for r in records]
    mean_wait = statistics.fmean(waits) if waits else 0.0
    dynamo = dynamo_counts()
    at_warmup = observed.dynamo_at_warmup or {"frames": dynamo["frames"], "graph_breaks": 0}
    skipped = observed.scaler_skipped()
    compiled = dynamo["frames"] > 0
    recompiled = max(0, dynamo["frames"] - at_warmup["frames"])
    syncs_per_step = statistics.fmean(r.syncs for r in records) if records else 0.0
    benchmark = bool(torch.backends.cudnn.benchmark)
    decoded = float(statistics.median(observed.jpeg_decoded_pixels)) if observed.jpeg_decoded_pixels else None
    observed_json = {
        "device": device, "threads": observed.threads, "parameters": observed.parameters,
        "autocast": sorted(observed.autocast),
        "compiled": compiled, "recompiled_frames": recompiled, "graph_breaks": dynamo["graph_breaks"],
        "scaler_steps": observed.scaler_steps, "scaler_skipped_steps": skipped, "syncs_per_step": syncs_per_step,
        "conv_weights": observed.conv_weights, "conv_weights_channels_last": observed.conv_weights_channels_last,
        "cudnn_benchmark": benchmark, "gpu_util_mean": gpu_util, "device_busy_fraction": device_busy,
        "jpeg_decoded_pixels_median": decoded,
    }
    if timeline.evaluation_steps:
        notes.append(f"{timeline.evaluation_steps} step(s) that spanned an evaluation pass (batches fetched with "
                     "gradients off) were left out of the figures")
    if not records:
        notes.append("no optimizer step was measured: the script ended or failed before "
                     f"{timeline.warmup_steps + 1} optimizer steps (warm-up {timeline.warmup_steps})")
    evidence = Evidence(
        verdict=verdict.name if verdict else "", device=device, fractions=fractions,
        step_s=statistics.median(r.total_s for r in records) if records else 0.0, steps=len(records),
        samples_per_s=samples / total if samples and total > 0 else None,
        syncs_per_step=syncs_per_step, cpus=available_cpus(), threads=observed.threads or torch.get_num_threads(),
        loaders=tuple(instrumentation.loaders), shm_bytes=(env or {}).get("shm_bytes"),
        autocast=tuple(sorted(observed.autocast)),
        scaler_skip_fraction=skipped / observed.scaler_steps if observed.scaler_steps else None,
        bf16_supported=device == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False),
        compiled=compiled, recompiled_frames=recompiled,
        graph_breaks=dynamo["graph_breaks"], conv_weights=observed.conv_weights,
        conv_weights_channels_last=observed.conv_weights_channels_last,
        cudnn_benchmark=benchmark, gpu_memory_fraction=_gpu_memory_fraction(device), jpeg_decoded_pixels=decoded,
        wait_spike_ratio=_percentile(waits, 0.95) / mean_wait if mean_wait > 0 else None,
        worker_rss_growth_per_min=_worker_rss_growth(monitor), loader_headroom=loader_headroom)
    return Report(
        verdict=verdict, fractions=fractions, steps=records, warmup_steps=timeline.warmup_steps,
        samples_per_s=evidence.samples_per_s, step_s=evidence.step_s if records else None,
        loaders=list(instrumentation.loaders), recommendations=recommend(evidence) if records else [],
        observed=observed_json, env=env or {}, monitor=_monitor_json(monitor), script=script or {}, notes=notes)


def _gpu_util(monitor: Any) -> float | None:
    if monitor is None:
        return None
    utils = [s.mean for name, s in monitor.summary().items() if name.startswith("gpu") and name.endswith(".util")]
    return statistics.fmean(utils) if utils else None


def _device_busy(instrumentation: Instrumentation, records: list[StepRecord]) -> float | None:
    """Share of the measured steps' wall time the GPU spent on their work (CUDA events; None without them)."""
    events = instrumentation.device_events
    if events is None or not events.pairs or not records:
        return None
    device_s = events.device_seconds()
    host_s = sum(r.total_s for r in records[-len(device_s):])
    return min(1.0, sum(device_s) / host_s) if host_s > 0 else None


def _worker_rss_growth(monitor: Any) -> float | None:
    """Bytes per minute the loader workers' resident memory grew by while measuring (copy-on-read shows here)."""
    if monitor is None or "workers.rss_bytes" not in monitor.metrics():
        return None
    times, values = monitor.series("workers.rss_bytes")
    return growth_per_minute(times, values) if len(values) >= 4 else None


def _gpu_memory_fraction(device: str) -> float | None:
    if device != "cuda":
        return None
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return torch.cuda.max_memory_allocated() / total if total else None


def _monitor_json(monitor: Any) -> dict[str, Any]:
    if monitor is None:
        return {}
    wanted = [m for m in monitor.metrics() if m in ("cpu.percent", "proc.rss_bytes", "workers.cpu_percent",
                                                    "workers.rss_bytes") or m.startswith("gpu")]
    return {"summary": {name: stats.to_json() for name, stats in monitor.summary().items()},
            "series": {name: [list(p) for p in zip(*monitor.series(name), strict=True)] for name in wanted},
            "unavailable": dict(getattr(monitor, "unavailable", {})),
            "gpu_sawtooth": monitor.gpu_sawtooth()}


VERDICT_STYLE = {"input-bound": "bold red", "transfer-bound": "bold red", "host-bound": "bold yellow",
                 "compute-bound": "bold green", "balanced": "bold cyan"}


def render_terminal(report: Report, console: Console) -> None:
    title = "trainfast doctor" + (f" — {report.script['target']}" if report.script.get("target") else "")
    console.rule(title)
    if report.script.get("outcome"):
        console.print(f"run: {report.script['outcome']}")
    if report.verdict is None:
        console.print("[bold]verdict: n/a[/] — no optimizer step was measured")
    else:
        style = VERDICT_STYLE.get(report.verdict.name, "bold")
        console.print(f"verdict: [{style}]{report.verdict.name.upper()}[/] — {report.verdict.reason}")
        rate = f"{report.samples_per_s:,.0f} samples/s, " if report.samples_per_s else ""
        console.print(f"measured {len(report.steps)} steps after {report.warmup_steps} warm-up: {rate}"
                      f"median step {1e3 * (report.step_s or 0):.1f} ms")
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
        table = Table(title="fixes, largest expected gain first", title_justify="left", show_lines=True)
        for column in ("id", "gain", "fix"):
            table.add_column(column, overflow="fold")
        for r in report.recommendations:
            gain = f"{r.expected_gain:.2f}x" if r.expected_gain else "?"
            table.add_row(r.id, gain, f"[bold]{r.title}[/]\nwhy: {r.why}\nfix: [cyan]{r.fix}[/]")
        console.print(table)
    elif report.verdict is not None:
        console.print("no fix to recommend from what was measured")
    for check in report.env.get("checks", []):
        if check.get("status") in ("warn", "fail"):
            console.print(f"[yellow]{check['status']}[/] {check['name']}: {check['detail']} — {check.get('fix', '')}")
    for note in report.notes:
        console.print(f"note: {note}")


def _split_bar(f: Fractions, width: int = 60) -> str:
    parts = [("data wait", f.data_wait, "red"), ("transfer", f.transfer, "magenta"), ("host", f.host, "yellow"),
             ("compute", f.compute, "green")]
    bar = "".join(f"[{color}]{'█' * round(share * width)}[/]" for _, share, color in parts)
    legend = "  ".join(f"[{color}]■[/] {name} {share:.0%}" for name, share, color in parts)
    return f"{bar}\n{legend}"
