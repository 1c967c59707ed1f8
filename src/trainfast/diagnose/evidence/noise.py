"""How far the measured figures can be trusted: the steps' spread, each part's bootstrap interval, and the cores
other processes kept busy while measuring."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

import psutil

from trainfast.diagnose.evidence.monitored import since_start
from trainfast.diagnose.evidence.periodic import Periodic
from trainfast.diagnose.records.findings import Note
from trainfast.diagnose.records.steps import StepRecord
from trainfast.monitor import percentile
from trainfast.monitor.series import Series

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
    if any(r.comm_s for r in records):
        parts["communication"] = [r.comm_s for r in records]
    return {name: share_interval(values, totals) for name, values in parts.items()}


def spread(records: list[StepRecord]) -> dict[str, float] | None:
    if not records:
        return None
    seconds = [r.total_s for r in records]
    return {"p10": percentile(seconds, 10), "p50": percentile(seconds, 50), "p90": percentile(seconds, 90)}


def contention(monitor: Series | None, measuring_from: float | None,
               cores_fallback: int | None = None) -> dict[str, Any] | None:
    """Cores other processes kept busy while measuring: all CPUs' busy time less this process and its workers
    (whose own use, over the same samples, is `own_cores_busy_mean`: a job's other ranks take it off theirs)."""
    since = since_start(monitor, measuring_from)
    if monitor is None or since is None or "cpu.percent" not in monitor.metrics():
        return None
    cores = (sum(1 for m in monitor.metrics() if m.startswith("cpu") and m[3:4].isdigit())
             or (psutil.cpu_count() if cores_fallback is None else cores_fallback) or 1)
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
                waiting_workers: bool = False, periodic: Periodic | None = None, restarted_workers: int = 0
                ) -> list[Note]:
    """The spread and contention notes. `waiting_workers`: the loop waits on loader workers that wait on reads;
    batches then arrive as the reads finish, a few at once, and steps alternate short and long by design.
    `periodic`: steps slow at a period (periodic.py), named first; the spread of the other steps decides whether
    anything is left to call uneven. `restarted_workers`: the training loader's workers, started anew each epoch.
    Other processes' CPU (`contention`) is the only thing that makes a wide spread the machine's."""
    notes = []
    contended = bool(contention and contention["other_cores_busy_mean"] >= CONTENTION_CORES)
    wide = bool(spread and spread["p50"] > 0 and spread["p90"] > NOISY_SPREAD * spread["p50"])
    if periodic is not None:
        notes.append(_periodic_note(periodic, restarted_workers))
        # the other steps: is anything left to call uneven?
        wide = periodic.other_p90_s > NOISY_SPREAD * periodic.typical_s > 0
        spread = {"p10": periodic.other_p10_s, "p50": periodic.typical_s, "p90": periodic.other_p90_s}
    if wide and spread is not None:
        which = "the other steps' times" if periodic is not None else "step times"
        if waiting_workers:
            why = (" because the batches arrive as the workers' reads finish, several at once and then none: the "
                   "split's shares are over all the measured steps")
        elif contended:
            why = ": the figures are unreliable; measure more steps (--steps) on a quieter machine"
        elif contention is None:  # other processes' CPU not measured: whose unevenness it is cannot be said
            why = (": the figures are unreliable; measure more steps (--steps) (other processes' CPU use was not "
                   "measured: whether they or the script's own steps make the spread is unknown)")
        else:  # not the machine: other processes used little CPU while measuring
            why = (f": the script's own steps are uneven (other processes kept only "
                   f"{contention['other_cores_busy_mean']:.2f} of {contention['cores']} cores busy); the split's "
                   "shares are over all the measured steps: measure more (--steps) to cover more of them")
        notes.append(f"{which} vary widely (p10 {spread['p10'] * 1e3:.1f} ms, p50 {spread['p50'] * 1e3:.1f} ms, "
                     f"p90 {spread['p90'] * 1e3:.1f} ms){why}")
    if contended and contention is not None:
        siblings = contention.get("sibling_cores_busy_mean")
        who = (f"other processes (not counting this job's other ranks here, {siblings:.1f} cores)" if siblings
               else "other processes")
        notes.append(f"{who} kept {contention['other_cores_busy_mean']:.1f} of {contention['cores']} "
                     "cores busy while measuring: the script's figures include that contention")
    return [Note(n, "noise") for n in notes]


def _periodic_note(periodic: Periodic, restarted_workers: int) -> str:
    """"every 8th step (each epoch's first) takes 1.9 s against 0.8 s: ...", and what the doctor makes of it."""
    if periodic.epoch_starts and restarted_workers:
        why = (f"the loader restarts its {restarted_workers} worker(s) each epoch (the last epoch's shutdown, the "
               "fork, the new workers filling their queues beside the step); see persistent_workers")
    elif periodic.epoch_starts:
        why = "each epoch's start (a new iterator over the loader: its first batches, a shuffle) costs that"
        if periodic.seen:
            why = f"each epoch's start and {' and '.join(periodic.seen)} there cost that"
    elif periodic.seen:
        why = f"{' and '.join(periodic.seen)} at those steps cost{'s' if len(periodic.seen) == 1 else ''} that"
    else:
        why = ("the script does something every that many steps that the doctor did not see there (no epoch "
               "start, checkpoint save, print or log, or evaluation forward): its own periodic work")
    return (f"{periodic.phrase()}: {why}; {periodic.excess_s * 1e3:.0f} ms beyond the other steps each time, "
            f"{periodic.excess_s / periodic.epoch_s:.0%} of the time")


def share_interval(parts: Sequence[float], totals: Sequence[float], *, confidence: float = 0.95,
                   resamples: int = 400, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of sum(parts) / sum(totals) over steps (seeded: the same steps, the same interval)."""
    if len(parts) != len(totals) or not totals:
        raise ValueError(f"need one part per step and at least one step, got {len(parts)} and {len(totals)}")
    rng = random.Random(seed)
    n = len(totals)
    shares = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        total = sum(totals[i] for i in picks)
        shares.append(sum(parts[i] for i in picks) / total if total > 0 else 0.0)
    shares.sort()
    tail = (1 - confidence) / 2
    return shares[int(tail * (resamples - 1))], shares[int((1 - tail) * (resamples - 1))]
