"""One doctor report per torchrun job, with the rank that holds the others back named.

Every rank runs the doctor and measures its own steps (run/doctor.py). Then each rank other than 0 sends a compact
summary of its figures (`rank_summary`) to the job's store, under the key prefix its stop step was agreed on, and
rank 0 gathers them (for at most GATHER_TIMEOUT_S: a rank that sends nothing is named in a note, never waited for
longer) into the job's one report (`merge`): the job's samples/s, a row per rank, and the straggler.

Why one rank's figures mislead: DDP and FSDP keep the ranks in lockstep (every step's gradients are all-reduced, or
reduce-scattered, inside backward, and a collective ends only when every rank has joined it), so a rank whose batch
comes late makes every other rank wait in that collective. Each rank times the collectives it is blocked in
(capture/comms.py: its exposed communication, its own part of the step), and that wait is in it: alone, the waiting rank
reads COMMUNICATION-BOUND (COMPUTE-BOUND where the wait is on the device, not the host: NCCL) and the late one
INPUT-BOUND. Together: a rank's own time per step outside the collectives' reach is its data wait + transfer +
host; the collective waits for the largest, so rank r waits about (largest - its own) per step, taken out of its
communication and compute (never more than the two).

A rank whose *compute* is slower (a slower or throttled device, another job on its cores) also makes the others
wait, in their communication; telling that apart from communication that is merely slow would need the ranks'
collectives compared call by call, which the report does not do yet, so such a straggler is not named. Each rank's
row shows its exposed communication beside its compute, and the report names the collectives the job issued.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from trainfast.diagnose.evidence.comms import collective_words
from trainfast.diagnose.evidence.noise import noise_notes
from trainfast.diagnose.records.findings import Note, Recommendation, Verdict
from trainfast.diagnose.records.steps import Fractions
from trainfast.diagnose.report.report import Report
from trainfast.launch import launch_env


class StoreStop(Protocol):
    """The stop agreement's store (capture/stop.py's `StoreStop`), which the ranks also send their figures through."""

    rank: int

    def store(self) -> Any:
        ...


log = logging.getLogger("trainfast.diagnose")


# The ranks stop at the same step (capture/stop.py), so they get here within one report's build of each other (a few
# seconds; more on a loaded machine, or with many loader workers to collect): a minute covers that, and bounds the
# wait for a rank that died or lost the store.
GATHER_TIMEOUT_S = 60.0


POLL_S = 0.05  # between two reads of the store while gathering: 20 round trips a second, ~100 us each


KEY = "ranks/{rank}"


RECEIVED = "ranks/received"  # rank 0's receipt: the ranks whose figures are in the job's report


# A rank is named the straggler when the others wait for it at least this share of the (median) step: below, evening
# the ranks out would gain under 1 / (1 - 0.1) = 1.11x, within the step-to-step spread of a DDP step on gloo on a
# shared machine, so the name would change from run to run.
STRAGGLER_SHARE = 0.10


# In lockstep the ranks' mean steps agree up to where each rank's measured window starts and ends (a fraction of a
# step at each end over the steps measured); further apart than this, the ranks do not wait for each other every
# step (no collective per step), and no rank is taken to wait for another.
LOCKSTEP_TOLERANCE = 0.2


# fraction -> straggler phase: a rank's own time outside the all-reduce's reach. (An RL loop's collection phase,
# timeline.py, stays with compute, as a slower rank's compute does: see the module doc.)
PARTS = {"data_wait": "input", "transfer": "transfer", "host": "host"}


PHASE_WORDS = {"input": "data wait", "transfer": "host-to-device copies", "host": "host work between steps"}


def rank_summary(report: Report, *, rank: int, exit_code: int, host: str | None = None) -> dict[str, Any]:
    """This rank's figures as rank 0 needs them for the job's report (JSON-able, a few kB)."""
    records = report.steps
    step_mean = statistics.fmean(r.total_s for r in records) if records else None
    fractions = report.fractions
    parts = None
    if fractions is not None and step_mean is not None:
        parts = {name: fractions.share(name) * step_mean for name in PARTS} | {
            "compute": fractions.compute * step_mean, "communication": fractions.communication * step_mean}
    collectives = report.observed.get("collectives") or {}
    return {
        "rank": rank, "host": host or socket.gethostname(), "steps_measured": len(records),
        "samples_per_s": report.samples_per_s, "step_s": report.step_s, "step_s_mean": step_mean,
        "step_s_percentiles": report.step_spread, "fractions": fractions.to_json() if fractions else None,
        "fractions_interval": report.intervals, "parts_s": parts,
        # the collectives this rank issued per step: names, and their seconds in all (None: not all timed)
        "collectives": list(collectives.get("kinds") or {}),
        "communication_total_s": collectives.get("seconds_per_step"),
        # DDP's all-reduce from its own timers (capture/comms.py): in all, and overlapped with the backward
        "ddp_all_reduce": collectives.get("ddp_all_reduce"),
        "verdict": report.verdict.name if report.verdict else None,
        "verdict_reason": report.verdict.reason if report.verdict else None,
        "input_source": report.input_source,
        # this process and its loader workers, over the measured steps: the other ranks' contention leaves it out
        "cpu_cores_busy": (report.contention or {}).get("own_cores_busy_mean"),
        "recommendations": [r.to_json() for r in report.recommendations],
        "exit_code": exit_code, "outcome": report.script.get("outcome"),
        # `--whole-run`: this rank's phases of its whole run (the job's report shows each rank's)
        "whole_run": _rank_phases(report.whole_run),
    }


def _rank_phases(whole: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if whole is None:
        return None
    return {"wall_s": whole["wall_s"], "goodput": whole["goodput"],
            "phases": {p["phase"]: p["seconds"] for p in whole["phases"]}}


def job_figures(summaries: Sequence[Mapping[str, Any]], *,
                complete: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[str]]:
    """Each rank's row of the job's report, the straggler (or None) and notes on what could not be judged.

    `complete`: every rank of the job is among `summaries`; without that no one's wait can be known (the missing
    rank may be the one the others wait for)."""
    rows = [{"rank": s["rank"], "host": s.get("host"), "samples_per_s": s.get("samples_per_s"),
             "step_s": s.get("step_s"), "step_s_percentiles": s.get("step_s_percentiles"),
             "fractions": s.get("fractions"), "verdict": s.get("verdict"), "steps_measured": s.get("steps_measured"),
             "waiting_for_ranks": None, "waiting_for_ranks_s": None, "whole_run": s.get("whole_run"),
             "communication_s": (s.get("parts_s") or {}).get("communication"),
             "communication_total_s": s.get("communication_total_s"), "collectives": s.get("collectives") or [],
             "ddp_all_reduce": s.get("ddp_all_reduce")}
            for s in summaries]
    notes: list[str] = []
    measured = [s for s in summaries if s.get("parts_s") and s.get("step_s_mean")]
    if not complete or len(summaries) < 2:
        return rows, None, notes
    if len(measured) < len(summaries):
        idle = ", ".join(str(s["rank"]) for s in summaries if s not in measured)
        notes.append(f"rank(s) {idle} measured no step: no rank's wait for another can be told")
        return rows, None, notes
    means = [float(s["step_s_mean"]) for s in measured]
    if min(means) < (1 - LOCKSTEP_TOLERANCE) * max(means):
        steps = ", ".join(f"rank {s['rank']} {_ms(float(s['step_s_mean']))}" for s in measured)
        notes.append(f"the ranks' mean steps differ ({steps}): they do not run in lockstep (no collective every "
                     "step), so no rank is taken to wait for another")
        return rows, None, notes
    own = {s["rank"]: sum(float(s["parts_s"][p]) for p in PARTS) for s in measured}
    slowest = max(measured, key=lambda s: (own[s["rank"]], -s["rank"]))  # ties: the lowest rank
    most = own[slowest["rank"]]
    for row, s in zip(rows, measured, strict=True):
        # the wait is in the collective: its exposed communication where the host is blocked there, else compute
        reach = float(s["parts_s"]["compute"]) + float(s["parts_s"].get("communication") or 0.0)
        waiting_s = min(most - own[s["rank"]], reach)
        row["waiting_for_ranks_s"] = waiting_s
        row["waiting_for_ranks"] = waiting_s / float(s["step_s_mean"])
    gap = max(float(row["waiting_for_ranks_s"]) for row in rows)
    step_s = statistics.median(float(s.get("step_s") or s["step_s_mean"]) for s in measured)
    if gap < STRAGGLER_SHARE * step_s:
        return rows, None, notes
    part = max(PARTS, key=lambda p: float(slowest["parts_s"][p]))
    seconds = float(slowest["parts_s"][part])
    straggler = {"rank": slowest["rank"], "phase": PARTS[part], "seconds_per_step": seconds,
                 "share": seconds / float(slowest["step_s_mean"])}
    return rows, straggler, notes


def merge(report: Report, summaries: Mapping[int, Mapping[str, Any]], *, world_size: int,
          why_missing: str | None = None, host: str | None = None) -> Report:
    """Rank 0's `report` made the job's: `summaries` by rank, this rank's included; a rank without one is named in
    a note (`why_missing`: what went wrong reading them, if anything did)."""
    ordered = [summaries[r] for r in sorted(summaries)]
    missing = [r for r in range(world_size) if r not in summaries]
    rows, straggler, notes_on_figures = job_figures(ordered, complete=not missing)
    notes = list(report.notes)
    if missing:
        why = f" ({why_missing})" if why_missing else f" within {GATHER_TIMEOUT_S:g} s"
        notes.append(Note(f"rank(s) {', '.join(map(str, missing))} of {world_size} sent no figures{why}: they are "
                          "not in this report, the job's samples/s is unknown and no straggler can be named", "job"))
    notes.extend(Note(n, "job") for n in notes_on_figures)
    for s in ordered:
        if s["rank"] != report.rank and s.get("exit_code"):
            notes.append(Note(f"rank {s['rank']}: {s.get('outcome') or 'exit code ' + str(s['exit_code'])}", "job"))
    rates = [s.get("samples_per_s") for s in ordered]
    # each rank trains its own batches (DistributedSampler): the job's rate is their sum
    job_rate = sum(float(r) for r in rates if r is not None) if not missing and None not in rates else None
    changes: dict[str, Any] = {}
    if straggler is not None:
        changes = _straggler_figures(summaries[straggler["rank"]], straggler, rows, this_rank=report.rank)
        notes.append(Note(changes.pop("note"), "job"))
    contention = _without_siblings(report, ordered, notes, host or socket.gethostname())
    return replace(report, samples_per_s=job_rate, world_size=world_size, ranks=rows, straggler=straggler,
                   contention=contention, notes=notes, **changes)


def _straggler_figures(summary: Mapping[str, Any], straggler: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                       *, this_rank: int) -> dict[str, Any]:
    """The job's verdict, split and fixes taken from the straggler's figures, and a note saying so."""
    rank, phase = straggler["rank"], straggler["phase"]
    words = ("input preparation before each forward" if phase == "input" and summary.get("input_source") == "script"
             else PHASE_WORDS[phase])
    waits = [float(r["waiting_for_ranks_s"]) for r in rows if r["rank"] != rank]
    reason = (f"on rank {rank}: its {words} ({_ms(straggler['seconds_per_step'])}/step, {straggler['share']:.0%} of "
              f"its step) holds the job back; the other rank(s) wait {_ms(max(waits))}/step for it in "
              f"{job_collectives(rows)}, which their own figures count as communication (or compute, where the wait "
              f"is on the device). Rank {rank} alone: {summary.get('verdict_reason') or 'n/a'}")
    name = summary.get("verdict") or {"input": "input-bound", "transfer": "transfer-bound", "host": "host-bound"}[phase]
    changes: dict[str, Any] = {"verdict": Verdict(name, reason), "fractions": Fractions(**summary["fractions"]),
                               "intervals": summary.get("fractions_interval")}
    if rank != this_rank:
        changes["recommendations"] = [Recommendation.from_json(r) for r in summary.get("recommendations") or []]
        changes["note"] = (f"the verdict, the split of the step and the fixes are rank {rank}'s, the straggler's; the "
                           f"timeline, loaders and the rest are rank {this_rank}'s, whose communication and compute "
                           "include "
                           f"{_ms(next(float(r['waiting_for_ranks_s']) for r in rows if r['rank'] == this_rank))}"
                           f"/step of waiting for rank {rank}")
    else:
        changes["note"] = f"rank {rank}, which writes this report, is the straggler: the figures are its own"
    return changes


def _without_siblings(report: Report, summaries: Sequence[Mapping[str, Any]], notes: list[Note],
                      host: str) -> dict[str, Any] | None:
    """The contention figures with the job's other ranks on this machine taken out of "other processes" (each
    rank's monitor counts its siblings among them); its note in `notes` is rewritten to match."""
    contention = report.contention
    siblings = sum(float(s.get("cpu_cores_busy") or 0.0) for s in summaries
                   if s["rank"] != report.rank and s.get("host") == host)
    if contention is None or siblings <= 0:
        return contention
    # Each rank samples on its own clock, so the siblings' use per sample is not known here: their mean comes off
    # the max as well as off the mean.
    adjusted = contention | {"other_cores_busy_mean": max(0.0, contention["other_cores_busy_mean"] - siblings),
                             "other_cores_busy_max": max(0.0, contention["other_cores_busy_max"] - siblings),
                             "sibling_cores_busy_mean": siblings}
    before, after = noise_notes(None, contention), noise_notes(None, adjusted)
    at = next((i for i, n in enumerate(notes) if n in before), len(notes))
    notes[:] = [n for n in notes[:at] if n not in before] + after + [n for n in notes[at:] if n not in before]
    return adjusted


def send(agreement: StoreStop, summary: Mapping[str, Any], *, timeout_s: float | None = None) -> str | None:
    """Put this rank's summary on the job's store for rank 0 and wait (up to `timeout_s`, GATHER_TIMEOUT_S) until
    rank 0 says it has it; None when it has, else what went wrong. Without the receipt a rank would take its
    figures for shown when rank 0 never read them: without torchrun's agent the store lives in rank 0's process
    group, which ends with the script, before the report is built."""
    limit_s = GATHER_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + limit_s
    try:
        store = agreement.store()
        if store is None:
            return "the job's store failed during the run"
        store.set(KEY.format(rank=agreement.rank), json.dumps(summary))
        while not store.check([RECEIVED]):
            if time.monotonic() >= deadline:
                return f"rank 0 did not take them within {limit_s:g} s"
            time.sleep(POLL_S)
        if agreement.rank not in json.loads(store.get(RECEIVED)):
            return "rank 0 stopped waiting for them"
    except Exception as e:  # DistStoreError, DistNetworkError, a timeout: the store is out of reach
        return f"the job's store failed: {type(e).__name__}: {e}"
    return None


def gather(agreement: StoreStop, world_size: int, *,
           timeout_s: float | None = None) -> tuple[dict[int, dict[str, Any]], str | None]:
    """The other ranks' summaries, by rank, as they arrive within `timeout_s` (GATHER_TIMEOUT_S), then the receipt
    saying which arrived; and what went wrong, if the store failed (a rank that is merely late is left out without
    an error)."""
    found: dict[int, dict[str, Any]] = {}
    pending = [r for r in range(world_size) if r != agreement.rank]
    deadline = time.monotonic() + (GATHER_TIMEOUT_S if timeout_s is None else timeout_s)
    try:
        store = agreement.store()
        if store is None:
            return found, "the job's store failed during the run"
        while pending and time.monotonic() < deadline:
            for r in [r for r in pending if store.check([KEY.format(rank=r)])]:
                found[r] = json.loads(store.get(KEY.format(rank=r)))
                pending.remove(r)
            if pending:
                time.sleep(POLL_S)
        store.set(RECEIVED, json.dumps(sorted(found)))
    except Exception as e:  # the store went away (its host ended): what arrived before still counts
        return found, f"the job's store failed: {type(e).__name__}: {e}"
    return found, None


def job_report(report: Report, agreement: StoreStop | None, *, world_size: int,
               exit_code: int) -> tuple[Report, bool]:
    """This rank's part in the job's report: on rank 0, the job's report (gathered); on another rank, its own
    report, sent to rank 0, and whether it got there (if not, the rank shows its own report)."""
    rank = agreement.rank if agreement is not None else _env_rank()
    report = replace(report, world_size=world_size, rank=rank)
    summary = rank_summary(report, rank=rank, exit_code=exit_code)
    if rank != 0:
        error = "no store to reach rank 0 through" if agreement is None else send(agreement, summary)
        if error is not None:
            log.warning("doctor: rank %d could not send its figures to rank 0 (%s): it shows its own report",
                        rank, error)
        return report, error is None
    others: dict[int, dict[str, Any]] = {}
    error = "no store to gather them through"
    if agreement is not None:
        others, error = gather(agreement, world_size)
    return merge(report, others | {rank: summary}, world_size=world_size, why_missing=error), False


def job_collectives(rows: Sequence[Mapping[str, Any]]) -> str:
    """The collectives the job's ranks issued, in words ('the all-reduce', 'the all-gathers and reduce-scatters')."""
    kinds: list[str] = []
    for row in rows:
        kinds.extend(k for k in row.get("collectives") or [] if k not in kinds)
    return collective_words(kinds)


def _env_rank() -> int:
    try:
        return launch_env().rank
    except ValueError:  # a malformed launch environment: this report is still shown, as rank 0's
        return 0


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms" if seconds >= 0.01 else f"{1e3 * seconds:.1f} ms"
