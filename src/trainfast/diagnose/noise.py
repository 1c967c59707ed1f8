"""How far the measured figures can be trusted: the steps' spread, each part's bootstrap interval, and the cores
other processes kept busy while measuring."""

from __future__ import annotations

import statistics
from typing import Any

import psutil

from trainfast.diagnose.classify import share_interval
from trainfast.diagnose.monitored import since_start
from trainfast.diagnose.timeline import StepRecord
from trainfast.monitor import Monitor, percentile

# A spread this wide (p90 over p50) makes per-step figures unreliable: other load, or uneven steps.
NOISY_SPREAD = 2.0
# Other processes busy on this many cores while measuring take time from the script's own.
CONTENTION_CORES = 0.5


def intervals(records: list[StepRecord]) -> dict[str, tuple[float, float]] | None:
    if len(records) < 3:
        return None
    totals = [r.total_s for r in records]
    parts = {"data_wait": [r.wait_s for r in records], "transfer": [r.transfer_s for r in records],
             "host": [r.host_s for r in records]}  # (not collection: one step a cycle has it, the cycle is the unit)
    return {name: share_interval(values, totals) for name, values in parts.items()}


def spread(records: list[StepRecord]) -> dict[str, float] | None:
    if not records:
        return None
    seconds = [r.total_s for r in records]
    return {"p10": percentile(seconds, 10), "p50": percentile(seconds, 50), "p90": percentile(seconds, 90)}


def contention(monitor: Monitor | None, measuring_from: float | None) -> dict[str, Any] | None:
    """Cores other processes kept busy while measuring: all CPUs' busy time less this process and its workers
    (whose own use, over the same samples, is `own_cores_busy_mean`: a job's other ranks take it off theirs)."""
    since = since_start(monitor, measuring_from)
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


def noise_notes(spread: dict[str, float] | None, contention: dict[str, Any] | None, *,
                waiting_workers: bool = False) -> list[str]:
    """The spread and contention notes. `waiting_workers`: the loop waits on loader workers that wait on reads;
    batches then arrive as the reads finish, a few at once, and steps alternate short and long by design."""
    notes = []
    if spread and spread["p50"] > 0 and spread["p90"] > NOISY_SPREAD * spread["p50"]:
        why = (" because the batches arrive as the workers' reads finish, several at once and then none: the split's "
               "shares are over all the measured steps" if waiting_workers else
               ": the figures are unreliable; measure more steps (--steps) on a quieter machine")
        notes.append(f"step times vary widely (p10 {spread['p10'] * 1e3:.1f} ms, p50 {spread['p50'] * 1e3:.1f} ms, "
                     f"p90 {spread['p90'] * 1e3:.1f} ms){why}")
    if contention and contention["other_cores_busy_mean"] >= CONTENTION_CORES:
        siblings = contention.get("sibling_cores_busy_mean")
        who = (f"other processes (not counting this job's other ranks here, {siblings:.1f} cores)" if siblings
               else "other processes")
        notes.append(f"{who} kept {contention['other_cores_busy_mean']:.1f} of {contention['cores']} "
                     "cores busy while measuring: the script's figures include that contention")
    return notes
