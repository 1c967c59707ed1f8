"""The whole run accounted for: a `Ledger`'s record (capture/ledger.py) turned into phases that add up to the wall
time, goodput, throughput over time and drift (pure functions; the report's `whole_run` entry).

The wall time runs from the process start to the script's end, less the doctor's own work inside it (`doctor_s`:
its scans, the timed candidate fixes, its set-up before the script began). Every instant of it belongs to one
phase: to the highest-priority interval covering it (checkpoint, then evaluation, epoch start, sleeping, printing/
logging, then the host work between those and the next step's input); else, by where it falls, to `startup`
(before the first training input: imports, building the data and the model), `train` (from there to the last
step's end) or `other` (after it). `compile` is taken out of `train` when torch.compile ran: the first steps'
excess over the steady step's median. The train phase keeps the doctor's split of a step (data wait, copies, host,
compute); an epoch's first batch is epoch start, not data wait.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainfast.diagnose.records.capture import Capture, LedgerRecord
from trainfast.diagnose.records.ledger import CHECKPOINT, DOCTOR, EPOCH_START, EVALUATION, LOGGING, SLEEP, Write
from trainfast.diagnose.records.steps import LoaderStats
from trainfast.diagnose.records.trials import Trial
from trainfast.trainer.phases import PHASES  # (the Trainer's own account of a fit uses the same phases)

BETWEEN = "between"  # host work in a step's input gap around an evaluation, a checkpoint or an epoch start


PRIORITY = (DOCTOR, CHECKPOINT, EVALUATION, EPOCH_START, SLEEP, LOGGING, BETWEEN)


# Throughput over time: this many intervals of consecutive steps at most (at least 10 when there are 10 steps)
INTERVALS = 20


# Drift: the last quarter of the steady steps against the first, beyond this relative change or twice the noise
# (drift()), whichever is larger
MIN_DRIFT = 0.05


MIN_DRIFT_STEPS = 8


def account(ledger: LedgerRecord, *, end: float, compiled: bool, warmup: int) -> dict[str, Any]:
    """The `whole_run` entry of the report (module doc). `end`: perf_counter time the script ended; `compiled`:
    torch.compile compiled frames in this run; `warmup`: the first steps that may hold compilation."""
    t0 = ledger.process_start
    n = len(ledger.step_start)
    first_input = ledger.first_input if n else None
    train_end = ledger.step_end[-1] if n else None
    ends = pass_ends(ledger, end)  # each evaluation pass's end: carved, and listed by pass
    intervals = _intervals(ledger, end, ends)
    segments = _sweep(intervals, t0, end)  # (start, end, category) of the carved time, no overlaps
    carved = _Carved(segments)
    seconds = dict.fromkeys((*PRIORITY, "startup", "train", "after"), 0.0)
    for start, stop, category in segments:
        seconds[category] += stop - start
    # the uncarved rest, by where it falls
    regions = [(t0, end, "after")]  # no training step: the run is all "other"
    if first_input is not None and train_end is not None:
        regions = [(t0, first_input, "startup"), (first_input, train_end, "train"), (train_end, end, "after")]
    for start, stop, category in regions:
        if stop > start:
            seconds[category] += (stop - start) - carved.within(start, stop)
    doctor_s = seconds[DOCTOR]
    train = _train_split(ledger, carved, 0, n)  # its seconds are seconds["train"]: the steps span that region
    compile_s = min(_compile_excess(ledger, carved, warmup), train["compute_s"]) if compiled else 0.0
    train["compute_s"] -= compile_s  # compilation ran inside the first steps' compute
    train_s = seconds["train"] - compile_s
    logging_s, sleep_s = seconds[LOGGING], seconds[SLEEP]
    other_host_s = seconds["after"] + seconds[BETWEEN]
    phases = {"startup": seconds["startup"], "compile": compile_s, "train": train_s,
              "evaluation": seconds[EVALUATION], "checkpoint": seconds[CHECKPOINT],
              "epoch_start": seconds[EPOCH_START], "other": logging_s + sleep_s + other_host_s}
    wall_s = end - t0 - doctor_s
    share = {k: (v / wall_s if wall_s > 0 else 0.0) for k, v in phases.items()}
    samples = int(sum(ledger.step_samples))
    throughput = _throughput(ledger, carved, t0)
    return {
        "wall_s": wall_s,
        "doctor_s": doctor_s,
        "doctor_parts_s": dict(ledger.doctor_parts),
        "phases": [{"phase": p, "seconds": phases[p], "share": share[p]} for p in PHASES],
        "goodput": share["train"],
        "badput": sorted(({"phase": p, "seconds": phases[p], "share": share[p]} for p in PHASES
                          if p != "train" and phases[p] > 0), key=lambda b: -b["seconds"]),
        "train": train | {"seconds": train_s, "samples": samples,
                          "samples_per_s": samples / train_s if train_s > 0 and samples else None},
        "seconds_per_sample": wall_s / samples if samples else None,
        "evaluation": _evaluation(ledger, end, ends),
        "checkpoint": _checkpoints(ledger, t0),
        "epoch_start": {"epochs": len(ledger.epoch_starts),
                        "seconds": [round(got - started, 6) for started, got, _ in ledger.epoch_starts]},
        "other": {"logging_s": logging_s, "sleep_s": sleep_s, "host_s": other_host_s},
        "throughput": throughput,
        "drift": drift(ledger, carved, warmup),
    }


def _intervals(ledger: LedgerRecord, end: float, pass_end: list[float]) -> list[tuple[str, float, float]]:
    """Every carved interval: the ledger's own, each evaluation pass (to its end in `pass_end`), each training
    epoch's start, and the host work in the input gap of a step that holds one of those (module doc)."""
    out = list(ledger.intervals)
    out += [(EVALUATION, p.start, stop) for p, stop in zip(ledger.passes, pass_end, strict=True)]
    out += [(EPOCH_START, started, got) for started, got, _ in ledger.epoch_starts]
    phases = [(s, e) for c, s, e in out if c in (EVALUATION, CHECKPOINT, EPOCH_START)]
    starts = ledger.step_start
    marked: set[int] = set()
    for start, _ in phases:
        i = bisect.bisect_right(starts, start) - 1
        if 0 <= i < len(starts) and start < ledger.step_end[i] and i not in marked:
            marked.add(i)
            out.append((BETWEEN, starts[i], starts[i] + ledger.step_gap[i]))
    return [(c, s, min(e, end)) for c, s, e in out if min(e, end) > s]


def pass_ends(ledger: LedgerRecord, end: float) -> list[float]:
    """Where each evaluation pass ends: past its last forward, through what the evaluation does with its outputs
    (a loss summed with .item(), metrics computed and printed: MNIST's test(), the HF Trainer's compute_metrics,
    Lightning's epoch-end hooks), up to the next thing that is not evaluation: the next training input, checkpoint
    write, sleep, training epoch's start or pass, or the script's end (one of those still running at its last
    forward ends it there). Where it prints or logs in between (its results: MNIST's "Test set: ...", the HF
    Trainer's metrics), it ends with its last print: what follows is the loop's (the HF Trainer's checkpoint
    preparation before its first write took 9 ms a pass). Ending at the last forward left its output's processing
    to training and host work: MNIST's evaluation measured 5.5 % of its run against 6.9 % timed by the script."""
    inputs = [start + gap for start, gap in zip(ledger.step_start, ledger.step_gap, strict=True)]
    others = sorted([(s, e) for c, s, e in ledger.intervals if c in (CHECKPOINT, SLEEP)]
                    + [(started, got) for started, got, _ in ledger.epoch_starts]
                    + [(p.start, p.end) for p in ledger.passes])
    starts = [s for s, _ in others]
    logs = sorted((e, s) for c, s, e in ledger.intervals if c == LOGGING)
    ends = []
    for p in ledger.passes:
        i, j = bisect.bisect_left(inputs, p.end), bisect.bisect_right(starts, p.end)
        stop = min(end, inputs[i] if i < len(inputs) else end, starts[j] if j < len(starts) else end)
        if any(e > p.end for s, e in others[bisect.bisect_left(starts, p.start):j] if (s, e) != (p.start, p.end)):
            stop = p.end  # a save or a sleep that began inside the pass goes on past its last forward
        k = bisect.bisect_right(logs, (stop, stop))
        if k and logs[k - 1][0] > p.end and logs[k - 1][1] >= p.end:  # its results printed: it ends there
            stop = logs[k - 1][0]
        ends.append(max(p.end, stop))
    return ends


def _sweep(intervals: list[tuple[str, float, float]], t0: float, end: float) -> list[tuple[float, float, str]]:
    """The carved time as non-overlapping segments, each given to the highest-priority interval covering it."""
    rank = {c: i for i, c in enumerate(PRIORITY)}
    points = sorted([(max(s, t0), 1, rank[c]) for c, s, e in intervals if e > t0]
                    + [(min(e, end), -1, rank[c]) for c, s, e in intervals if e > t0])
    active = [0] * len(PRIORITY)
    segments: list[tuple[float, float, str]] = []
    last = t0
    for at, delta, which in points:
        if at > last:
            top = next((i for i, count in enumerate(active) if count > 0), None)
            if top is not None:
                if segments and segments[-1][2] == PRIORITY[top] and segments[-1][1] == last:
                    segments[-1] = (segments[-1][0], at, PRIORITY[top])
                else:
                    segments.append((last, at, PRIORITY[top]))
            last = at
        active[which] += delta
    return segments


class _Carved:
    """Carved seconds within any [a, b], from the sorted segments' prefix sums."""

    def __init__(self, segments: list[tuple[float, float, str]]) -> None:
        self.starts = [s for s, _, _ in segments]
        self.ends = [e for _, e, _ in segments]
        self.before = [0.0]
        for s, e, _ in segments:
            self.before.append(self.before[-1] + e - s)

    def _until(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t)  # segments starting at or before t
        if i == 0:
            return 0.0
        return self.before[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def within(self, a: float, b: float) -> float:
        return max(0.0, self._until(b) - self._until(a)) if b > a else 0.0


def _train_s(ledger: LedgerRecord, carved: _Carved, lo: int, hi: int) -> float:
    """The training seconds of steps lo..hi-1: their span less what was carved out of it."""
    start, end = ledger.step_start[lo], ledger.step_end[hi - 1]
    return (end - start) - carved.within(start, end)


def _train_split(ledger: LedgerRecord, carved: _Carved, lo: int, hi: int) -> dict[str, Any]:
    """The doctor's split of steps lo..hi-1: data wait (an epoch's first batch is epoch start), copies, host (the
    input gap with a loader; without one the gap is input preparation, data wait) and compute, the rest."""
    if hi <= lo:
        return {"steps": 0, "seconds": 0.0, "data_wait_s": 0.0, "transfer_s": 0.0, "host_s": 0.0, "compute_s": 0.0}
    start, end = ledger.step_start[lo], ledger.step_end[hi - 1]
    span_train = _train_s(ledger, carved, lo, hi)
    epoch_waits = sum(wait for _, got, wait in ledger.epoch_starts if start <= got <= end)
    wait = max(0.0, sum(ledger.step_wait[lo:hi]) - epoch_waits)
    transfer = sum(ledger.step_transfer[lo:hi])
    gaps = sum(ledger.step_gap[lo:hi])
    gap_carved = max(0.0, carved.within(start, end) - sum(
        got - started for started, got, _ in ledger.epoch_starts if start <= got <= end))
    gap = max(0.0, gaps - gap_carved)
    host = gap if ledger.loader_fed else 0.0
    if not ledger.loader_fed:
        wait += gap
    compute = max(0.0, span_train - wait - transfer - host)
    return {"steps": hi - lo, "seconds": span_train, "data_wait_s": wait, "transfer_s": transfer, "host_s": host,
            "compute_s": compute}


def _compile_excess(ledger: LedgerRecord, carved: _Carved, warmup: int) -> float:
    """torch.compile's share of the first steps: their excess over the median of the steps after them."""
    n = len(ledger.step_start)
    first = max(1, warmup)
    if n <= first:
        return 0.0
    steady = statistics.median(_train_s(ledger, carved, i, i + 1) for i in range(first, n))
    return sum(max(0.0, _train_s(ledger, carved, i, i + 1) - steady) for i in range(first))


def _throughput(ledger: LedgerRecord, carved: _Carved, t0: float) -> list[dict[str, Any]]:
    """samples/s over consecutive runs of steps (at most `INTERVALS`), over their own training time (what an
    evaluation between them took is not theirs), with the step's split per step."""
    n = len(ledger.step_start)
    count = min(INTERVALS, n)
    out = []
    for k in range(count):
        lo, hi = k * n // count, (k + 1) * n // count
        if hi <= lo:
            continue
        split = _train_split(ledger, carved, lo, hi)
        start, end, train_s = ledger.step_start[lo], ledger.step_end[hi - 1], split["seconds"]
        samples = int(sum(ledger.step_samples[lo:hi]))
        steps = hi - lo
        out.append({"start_s": start - t0, "end_s": end - t0, "steps": steps, "samples": samples,
                    "samples_per_s": samples / train_s if train_s > 0 and samples else None,
                    "step_s": train_s / steps,
                    **{k2: split[k2] / steps for k2 in ("data_wait_s", "transfer_s", "host_s", "compute_s")}})
    return out


def drift(ledger: LedgerRecord, carved: _Carved, warmup: int) -> dict[str, Any]:
    """The last quarter of the steady steps against the first: slower beyond the noise, and the part of the step
    that grew. The noise is the two quarters' own spread: twice the standard error of the difference of their
    median step (1.25 x the robust standard deviation over the square root of the steps), at least `MIN_DRIFT`."""
    n = len(ledger.step_start)
    lo = min(max(1, warmup), n)
    steady = n - lo
    if steady < MIN_DRIFT_STEPS:
        return {"drifted": None, "reason": f"{steady} steady step(s): too few to compare the run's start and end"}
    quarter = steady // 4
    first = _train_split(ledger, carved, lo, lo + quarter)
    last = _train_split(ledger, carved, n - quarter, n)
    first_rate = _rate(ledger, carved, lo, lo + quarter)
    last_rate = _rate(ledger, carved, n - quarter, n)
    spreads = [_relative_spread([_train_s(ledger, carved, i, i + 1) for i in range(a, a + quarter)])
               for a in (lo, n - quarter)]
    noise = 1.25 * math.hypot(*spreads) / math.sqrt(quarter)
    threshold = max(MIN_DRIFT, 2 * noise)
    change = last_rate / first_rate - 1 if first_rate and last_rate else None
    parts = {p: (last[p] - first[p]) / quarter for p in ("data_wait_s", "transfer_s", "host_s", "compute_s")}
    grew = max(parts, key=lambda p: parts[p])
    drifted = change is not None and change < -threshold
    return {"drifted": drifted, "first_samples_per_s": first_rate, "last_samples_per_s": last_rate,
            "change": change, "noise": noise, "threshold": threshold,
            "part": grew.removesuffix("_s") if drifted else None,
            "part_growth_s": parts[grew] if drifted else None,
            "reason": _drift_reason(drifted, change, threshold, grew, parts[grew])}


def _relative_spread(values: list[float]) -> float:
    """The robust standard deviation (1.4826 x the median absolute deviation) over the median."""
    middle = statistics.median(values)
    if middle <= 0:
        return 0.0
    return 1.4826 * statistics.median(abs(v - middle) for v in values) / middle


def _drift_reason(drifted: bool, change: float | None, threshold: float, part: str, growth: float) -> str:
    if change is None:
        return "no samples counted: no rate to compare"
    if change > threshold:
        return (f"the last quarter of the steady steps ran {change:.0%} faster than the first (beyond the noise, "
                f"±{threshold:.0%}): no slowdown; a run that speeds up was slowed at its start (other processes, "
                "a cache filling)")
    if not drifted:
        return (f"the last quarter of the steady steps ran at {change:+.1%} of the first quarter's rate, within "
                f"the noise (±{threshold:.0%})")
    why = {"data_wait_s": "data wait grew (the page cache no longer holding the data, slower storage, a loader "
                          "falling behind)",
           "compute_s": "compute grew (a dynamic shape growing, recompilation, thermal or frequency limits, other "
                        "processes on the cores)",
           "host_s": "host work between steps grew (logging, metrics kept in a growing list)",
           "transfer_s": "host-to-device copies grew"}[part]
    return (f"the last quarter of the steady steps ran {-change:.0%} slower than the first (beyond the noise, "
            f"±{threshold:.0%}): {why}, +{growth * 1e3:.1f} ms a step")


def _rate(ledger: LedgerRecord, carved: _Carved, lo: int, hi: int) -> float | None:
    if hi <= lo:
        return None
    seconds = _train_s(ledger, carved, lo, hi)
    samples = sum(ledger.step_samples[lo:hi])
    return samples / seconds if seconds > 0 and samples else None


def _evaluation(ledger: LedgerRecord, end: float, pass_end: list[float]) -> dict[str, Any]:
    passes = ledger.passes
    forwards = sum(p.forwards for p in passes)
    return {"passes": len(passes), "forwards": forwards, "data_wait_s": sum(p.wait_s for p in passes),
            "autocast_forwards": sum(p.autocast_forwards for p in passes),
            "seconds": [round(min(stop, end) - p.start, 6) for p, stop in zip(passes, pass_end, strict=True)][:100]}


def _checkpoints(ledger: LedgerRecord, t0: float) -> dict[str, Any]:
    def entry(w: Write) -> dict[str, Any]:
        seconds = w.end - w.start
        return {"api": w.api, "at_s": w.start - t0, "seconds": seconds, "bytes": w.bytes,
                "mb_per_s": w.bytes / seconds / 1e6 if w.bytes and seconds > 0 else None,
                "background": w.background}
    totals = ledger.write_totals
    blocking = [w for w in ledger.writes if not w.background]
    return {"writes": [entry(w) for w in ledger.writes], "count": int(totals["count"]),
            "bytes": int(totals["bytes"]), "seconds": totals["seconds"],
            "blocking_s": sum(w.end - w.start for w in blocking)}


def whole_entry(capture: Capture) -> dict[str, Any] | None:
    """The report's `whole_run` entry (`account`), with the evaluation's trial and the progress lost to restarts."""
    whole = capture.whole
    if whole is None:
        return None
    entry = account(whole.ledger, end=whole.end, compiled=whole.compiled, warmup=whole.warmup)
    if whole.trial is not None:
        entry["evaluation"]["trial"] = whole.trial.to_json()
    entry["lost_progress"] = whole.lost_progress
    return entry


@dataclass(frozen=True)
class RunEvidence:
    """What the whole run's fixes read (fixes/run.py), from its accounting (`account`) and what was timed after it."""

    entry: Mapping[str, object]  # the report's `whole_run` entry
    wall_s: float
    seconds: Mapping[str, float]  # each phase's
    share: Mapping[str, float]  # of the wall time
    evaluation_passes: int
    evaluation_forwards: int
    evaluation_wait_s: float
    checkpoint_blocking_s: float
    blocking_write_bytes: tuple[int | None, ...]  # each write that stopped training
    restarts_s: tuple[float, ...]  # iter() to the first batch of each epoch after the first
    training_loaders: tuple[LoaderStats, ...]  # those with worker processes
    eval_trial: Trial | None  # evaluation under autocast + inference_mode against the script's
    bandwidth: float | None  # bytes/s of a copy to host memory
    step_wait_s: float | None  # the measured steps' median data wait


def run_evidence(entry: Mapping[str, Any], *, loaders: Sequence[LoaderStats], trial: Trial | None,
                 bandwidth: float | None, step_wait_s: float | None) -> RunEvidence:
    evaluation, checkpoint = entry["evaluation"], entry["checkpoint"]
    return RunEvidence(
        entry=entry, wall_s=entry["wall_s"], seconds={p["phase"]: p["seconds"] for p in entry["phases"]},
        share={p["phase"]: p["share"] for p in entry["phases"]}, evaluation_passes=evaluation["passes"],
        evaluation_forwards=evaluation["forwards"], evaluation_wait_s=evaluation["data_wait_s"],
        checkpoint_blocking_s=checkpoint["blocking_s"],
        blocking_write_bytes=tuple(w["bytes"] for w in checkpoint["writes"] if not w["background"]),
        restarts_s=tuple(entry["epoch_start"]["seconds"][1:]),
        training_loaders=tuple(s for s in loaders if s.num_workers and s.batches > s.evaluation_batches),
        eval_trial=trial, bandwidth=bandwidth, step_wait_s=step_wait_s)
