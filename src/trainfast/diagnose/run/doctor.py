"""The zero-code doctor, wired: run an unmodified script or module under the hooks, capture the run, build the report
from the capture, merge a torchrun job's ranks, and verify the fixes when asked. Each step is a stage's own
(`trainfast/diagnose/`: records, capture, evidence, verdict, fixes, report, show); this module only calls them in
order, and decides what the fixes want timed while the script is still alive.

The script runs in this process (capture/script.py). After `warmup` steps, `steps` more are measured; then a hook
raises `StopMeasuring`, a BaseException the script's `except Exception:` cannot swallow, and the script unwinds.
After `max_seconds` of wall time the run stops the same way (from the next step boundary, or from a SIGALRM handler
when the script is stuck elsewhere) and the report says what was measured by then. Every patch is removed whatever
happens: normal end, `sys.exit`, a crash, or the stop.

When the measured steps end, the candidate fixes (mixed precision, or float32 where the script autocasts,
channels_last, another intra-op thread count: on 2 CPUs a compute-heavy step can take 1.8x as long on one thread,
which turns "more workers" into a slowdown) are timed on a copy of the script's model (the model itself, put back,
where it cannot be copied) and its first training input (capture/probe.py), within half the budget left: the rules
say which (fixes/rule.py `trials_wanted`), from the evidence so far. A whole run's fixes say likewise what they want
timed once the script has ended (the evaluation under autocast, a copy to host memory).

Under torchrun (2+ ranks, each running the doctor) no rank stops on its own clock (capture/stop.py), and rank 0's
report is the job's (report/job.py).

The report reads `cudnn.benchmark` as the script had it when its measured steps ended (or, stopped before, when it
ended): torch_settings() puts back the value from before the script, and a script that set it (or one that sets it
and puts it back on its way out, which the doctor's stop unwinds through) would be told to set it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainfast.diagnose.capture.attempts import agent_store, attempt_of, lost_progress, record_for, restarts_left
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.probe_hook import gain_probe
from trainfast.diagnose.capture.script import (
    ScriptEnd,
    end_process_group,
    failed_step,
    own_setup_s,
    process_group_up,
    process_start,
    run_script,
)
from trainfast.diagnose.capture.stop import _RUNS, StoreStop, launched_ranks, rank_agreement
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.capture.whole_trials import WholeRun, copy_bandwidth, eval_trial
from trainfast.diagnose.capture.window import MEASURE
from trainfast.diagnose.evidence.evidence import evidence_of
from trainfast.diagnose.evidence.wholerun import account, run_evidence
from trainfast.diagnose.fixes.rule import run_trials_wanted, trials_wanted
from trainfast.diagnose.records.losses import LossTrace
from trainfast.diagnose.records.steps import LoaderStats
from trainfast.diagnose.report.job import job_report
from trainfast.diagnose.report.report import Report, build
from trainfast.diagnose.report.verify import torchrun_refusal, verify_report
from trainfast.dynamo import dynamo_counts
from trainfast.envcheck.environment import environment, preflight
from trainfast.launch import launch_env
from trainfast.monitor import Monitor
from trainfast.trainer.settings import torch_settings

log = logging.getLogger("trainfast.diagnose")


@dataclass(frozen=True)
class DoctorRun:
    report: Report
    exit_code: int  # the script's own: 0 when it finished or was stopped after enough steps
    error: str | None  # the script's traceback, when it crashed
    # Under torchrun: rank 0's `report` is the job's (every rank's figures, report/job.py); another rank's is its
    # own, `published` when its figures reached rank 0 through the job's store.
    rank: int = 0
    world_size: int = 1
    published: bool = False
    # The script's own loss per step, as its backwards saw it (capture/losses.py): what `--verify` compares between
    # a fix's run and the baselines' (records/losses.py). Not in the report: a report is a function of its capture.
    loss: LossTrace | None = None


# Long enough for a slow start (dataset indexing, compilation) and 35 steps of a second each.
DEFAULT_MAX_SECONDS = 300.0


def run_doctor(target: str, *, module: bool = False, args: list[str] | None = None, steps: int = 30,
               warmup: int = 5, max_seconds: float | None = DEFAULT_MAX_SECONDS,
               monitor_interval_s: float = 0.5, probe_gains: bool = True, whole_run: bool = False,
               from_process_start: bool = False, verify: bool = False, verify_repeats: int = 1,
               progress: Callable[[str], None] | None = None) -> DoctorRun:
    """Run `target` (a script path, or a module name with `module=True`) and measure `steps` steps, stopping it
    after `max_seconds` of wall time whatever it has measured by then (None: no limit). `probe_gains=False` skips
    timing the candidate fixes on a copy of the model (a `--verify` run measures the fix itself). `whole_run`: the
    script runs on after the measured steps, to its end (or `max_seconds`), and the report accounts for all of it
    (evidence/wholerun.py): from the process's start with `from_process_start` (the CLI: the interpreter and the
    imports are the script's start-up too), else from this call. `verify`: then re-run the script once per fix
    that can be injected, `verify_repeats` times (report/verify.py), saying how it goes through `progress`."""
    entered = time.perf_counter()
    if not module and not Path(target).is_file():
        raise FileNotFoundError(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds={max_seconds!r}: give a positive number of seconds, or None for no limit")
    if verify and (refusal := torchrun_refusal(target, module=module)) is not None:
        raise RuntimeError(refusal)  # before the script runs: nothing to measure twice
    timeline = Timeline(warmup_steps=warmup, max_steps=steps)
    timeline.stop_when_done = not whole_run
    ledger = record = None
    run = next(_RUNS)
    if whole_run:
        ledger = Ledger(process_start=process_start(entered) if from_process_start else entered)
        if from_process_start:  # importing the doctor itself is not the script's start-up
            ledger.doctor(own_setup_s(entered), "set-up", end=entered)
        store = agent_store()  # under torchrun with --max-restarts: this attempt's record (capture/attempts.py)
        record = record_for(store, ledger, run)
    timeline.agreement = agreement = rank_agreement(run=run)
    started = time.perf_counter()
    if max_seconds is not None:
        timeline.deadline = started + max_seconds
    checks: list[dict[str, Any]] = []
    seen_loaders: set[int] = set()

    def on_loader(loader: Any) -> None:  # the pre-flight, before each loader's first batch
        if id(loader) not in seen_loaders:
            seen_loaders.add(id(loader))
            checks.extend(c.to_json() | {"loader": len(seen_loaders) - 1} for c in preflight(loader)
                          if c.status in ("warn", "fail"))

    distributed_before = process_group_up()
    # An optimizer's constructor imports torch._dynamo, which keeps a table of Tensor's methods: imported while
    # our counting wrappers are in place, it would keep them (and the whole run) for the rest of the process.
    import torch._dynamo
    end: ScriptEnd | None = None
    # torch_settings() puts back the thread count, cudnn.benchmark and TF32 the script may change
    with torch_settings(), Monitor(interval_s=monitor_interval_s) as monitor, \
            Instrumentation(timeline, on_loader=on_loader, ledger=ledger) as inst:
        # The candidate fixes, timed on a copy of the model when the measured steps end (capture/probe.py). Under
        # torchrun too: a replay holds no collective, so a rank that takes longer only delays its peers' next
        # all-reduce.
        probe = probe_hook(timeline, inst) if probe_gains else None
        measured_benchmark: list[bool] = []  # cudnn.benchmark as the script had it when the measured steps ended

        def on_phase_end(phase: str) -> None:
            if phase == MEASURE:
                measured_benchmark.append(torch.backends.cudnn.benchmark)
            if probe is not None:
                probe(phase)
        timeline.on_phase_end = on_phase_end
        if record is not None:
            record.start()
        try:
            remaining = None if max_seconds is None else max(1e-3, started + max_seconds - time.perf_counter())
            end = run_script(target, module=module, args=args, timeline=timeline, observed=inst.observed,
                             seconds=remaining, budget_s=max_seconds)
        finally:
            timeline.finish()
            if record is not None:  # after finish(): the step the run ended in is closed
                record.end(end.outcome if end is not None else "the script ended")
            timeline.agreement = None  # (its store connection goes with it)
            script_benchmark = measured_benchmark[0] if measured_benchmark else torch.backends.cudnn.benchmark
        gc.collect()  # the unwound script's loaders (and their worker processes) go now, not at exit
    assert end is not None  # (run_script ends every way the script can)
    whole = None if ledger is None else whole_run_entry(ledger, inst, end=end.ended, warmup=warmup,
                                                         loaders=inst.loaders)
    if whole is not None:  # after torchrun restarted the job (capture/attempts.py)
        whole.lost = whole.entry["lost_progress"] = None if record is None else lost_progress(
            record.store, attempt=attempt_of(), run=run, started=record.ledger.process_start + record.to_unix)
    loss = inst.steps.losses.read()  # (after the script: reading the scalars waits for the device once)
    try:
        result = _report(timeline, inst, monitor, checks=checks, target=target, module=module, args=args, end=end,
                         steps=steps, script_benchmark=script_benchmark, agreement=agreement, whole=whole)
        result = replace(result, loss=loss)
    finally:
        # After the job's report: without torchrun's agent, rank 0's process group hosts the store the ranks
        # send their figures through
        if not distributed_before:
            end_process_group()
    if verify and result.rank == 0:
        limit = max_seconds if whole_run else max_seconds or DEFAULT_MAX_SECONDS  # (a whole run: to its end)
        verified = verify_report(result.report, target, module=module, args=args, steps=steps, warmup=warmup,
                                 max_seconds=limit, repeats=verify_repeats, progress=progress)
        result = replace(result, report=verified)
    return result


def _report(timeline: Timeline, inst: Instrumentation, monitor: Monitor, *, checks: list[dict[str, Any]],
            target: str, module: bool, args: list[str] | None, end: ScriptEnd, steps: int, script_benchmark: bool,
            agreement: StoreStop | None, whole: WholeRun | None = None) -> DoctorRun:
    """The run's report; under torchrun, rank 0's is the job's (report/job.py), the others send theirs."""
    env = environment()
    env["checks"] = [*env.get("checks", []), *checks]
    exit_code, error, oom = end.exit_code, end.error, end.oom
    script = {"target": f"-m {target}" if module else target, "args": list(args or []), "outcome": end.outcome,
              "exit_code": exit_code, "error": error}
    if oom is not None:
        oom["step"] = failed_step(timeline)
    notes = []
    if 0 < len(timeline.records) < steps:
        notes.append(f"only {len(timeline.records)} of the {steps} requested steps were measured before the script "
                     "ended; the figures are less certain")
    with torch_settings(cudnn_benchmark=script_benchmark):  # the script's choice, which the report reads
        report = build_report(timeline, inst, monitor=monitor, env=env, script=script, notes=notes, oom=oom,
                              whole=whole)
    world_size = launched_ranks()
    if world_size < 2:
        return DoctorRun(report=report, exit_code=exit_code, error=error)
    if exit_code != 0 and restarts_left():  # torchrun's agent stops every rank and starts the job again now:
        rank = launch_env().rank  # waiting for the other ranks' figures would only delay the restart (by 60 s)
        log.warning("doctor: the script failed on rank %d and torchrun will restart the job: this rank's own "
                    "report, not the job's (the next attempt's report counts the steps trained again)", rank)
        return DoctorRun(report=replace(report, world_size=world_size, rank=rank), exit_code=exit_code, error=error,
                         rank=rank, world_size=world_size)
    report, published = job_report(report, agreement, world_size=world_size, exit_code=exit_code)
    return DoctorRun(report=report, exit_code=exit_code, error=error, rank=report.rank, world_size=world_size,
                     published=published)


def build_report(timeline: Timeline, instrumentation: Instrumentation, **what: Any) -> Report:
    """The report of what the hooks measured: the run frozen (`Instrumentation.snapshot`), then the report made from
    that capture alone (report/report.py `build`). `what`: the rest of the capture (`snapshot`'s keywords)."""
    return build(instrumentation.snapshot(**what))


def probe_hook(timeline: Timeline, instrumentation: Instrumentation) -> Callable[[str], None]:
    """The probe (capture/probe_hook.py), timing what the fixes want timed (fixes/rule.py `trials_wanted`), from the
    evidence of the steps measured so far."""
    return gain_probe(timeline, instrumentation,
                      lambda: trials_wanted(evidence_of(instrumentation.snapshot(final=False))))


def whole_run_entry(ledger: Ledger, instrumentation: Instrumentation, *, end: float, warmup: int,
                    loaders: Sequence[LoaderStats] = ()) -> WholeRun:
    """Account for the run that ended at `end` (perf_counter), then time what its fixes want (fixes/rule.py
    `run_trials_wanted`; after the script: the doctor's time, not the script's)."""
    observed = instrumentation.observed
    compiled = observed.compiled_model or dynamo_counts().get("frames", 0) > observed.dynamo_at_start.get("frames", 0)
    entry = account(ledger.record(), end=end, compiled=compiled, warmup=warmup)
    wanted = run_trials_wanted(run_evidence(entry, loaders=loaders, trial=None, bandwidth=None, step_wait_s=None))
    trial = eval_trial(ledger, tuple(sorted(observed.autocast))) if "evaluation" in wanted else None
    if trial is not None:
        entry["evaluation"]["trial"] = trial.to_json()
    ledger.eval_call = None
    bandwidth = copy_bandwidth() if "copy" in wanted else None
    return WholeRun(entry, trial, bandwidth, ledger=ledger, end=end, compiled=compiled, warmup=warmup)
