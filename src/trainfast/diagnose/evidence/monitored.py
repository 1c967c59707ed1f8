"""What the monitor's samples say about the measured steps: GPU utilisation, the workers' memory growth, and the
series the report keeps."""

from __future__ import annotations

import statistics
from typing import Any

from trainfast.diagnose.records.capture import TimelineRecord
from trainfast.monitor import sustained_growth_per_minute
from trainfast.monitor.analysis import window_mean
from trainfast.monitor.series import Series


def since_start(monitor: Series | None, monotonic: float | None) -> float | None:
    """A `time.monotonic()` instant on the monitor's series clock (seconds since it started)."""
    started = monitor.started_at if monitor is not None else None
    return None if monotonic is None or started is None else monotonic - started


def gpu_util(monitor: Series | None, timeline: TimelineRecord,
             model_index: int | None) -> tuple[float | None, list[str]]:
    """Mean NVML utilisation (%) of the GPUs this process uses, over the measured steps only, and their NVML names.

    Another GPU of the node, busy or idle, says nothing about this run, nor does the start-up before the
    measured steps (data set indexing, compilation): averaged in, they make a busy GPU look idle, a false
    host-bound verdict. The GPUs used: the model's, and any other this process held tensors on while
    measuring. None when no sample fell in the window or a GPU cannot be matched to NVML's (torch and NVML
    number GPUs differently; see monitor/sources.py)."""
    since = since_start(monitor, timeline.measure_started_monotonic)
    until = since_start(monitor, timeline.measure_ended_monotonic)
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


def worker_private_growth(monitor: Series | None, measuring_from: float | None,
                          measuring_to: float | None = None) -> float | None:
    """Sustained growth (bytes/min) of the warm workers' private memory while measuring: copy-on-read. Not their
    RSS, which copied pages leave unchanged and restarted workers step up (see monitor.sources.PsutilSource).
    Samples after the measured steps are left out: workers shutting down as the run stops read as a drop."""
    since, until = since_start(monitor, measuring_from), since_start(monitor, measuring_to)
    if monitor is None or since is None or "workers.private_bytes" not in monitor.metrics():
        return None
    times, values = monitor.series("workers.private_bytes")  # not in every sample: matched to the others by time
    if until is not None:
        kept = [i for i, t in enumerate(times) if t <= until]
        times, values = [times[i] for i in kept], [values[i] for i in kept]
    counts, started = (dict(zip(*monitor.series(m), strict=True)) for m in ("workers.count", "workers.started"))
    if any(t not in counts or t not in started for t in times):
        return None
    return sustained_growth_per_minute(times, values, [counts[t] for t in times], since=since,
                                       started=[started[t] for t in times])


def monitor_json(monitor: Series | None) -> dict[str, Any]:
    """The report's "monitor" entry: the summaries, the series the HTML page draws, what could not be sampled."""
    if monitor is None:
        return {}
    wanted = [m for m in monitor.metrics() if m in ("cpu.percent", "proc.rss_bytes", "workers.cpu_percent",
                                                    "workers.rss_bytes") or m.startswith("gpu")]
    return {"summary": {name: stats.to_json() for name, stats in monitor.summary().items()},
            "series": {name: [list(p) for p in zip(*monitor.series(name), strict=True)] for name in wanted},
            "unavailable": dict(monitor.unavailable),
            "gpu_sawtooth": monitor.gpu_sawtooth()}
