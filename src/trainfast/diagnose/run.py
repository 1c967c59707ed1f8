"""The zero-code doctor: run an unmodified script or module under instrumentation, then report.

The script runs in this process through `runpy`, with its own `sys.argv` and `sys.path[0]` and as
`__main__` (so its `if __name__ == "__main__":` block runs and spawned DataLoader workers can re-import
it). After `warmup` steps, `steps` more are measured; then a hook raises `StopMeasuring`, a BaseException
the script's `except Exception:` cannot swallow, and the script unwinds. After `max_seconds` of wall time
the run stops the same way (from the next step boundary, or from a SIGALRM handler when the script is stuck
elsewhere) and the report says what was measured by then. Every patch is removed whatever happens: normal
end, `sys.exit`, a crash, or the stop.

A crash that is an out-of-memory error (CUDA's, or the CPU allocator's "can't allocate memory") gets the
report's `oom` entry: where it happened, what the allocator held (read in the `except` block, while the failed
step's tensors are still alive) and what to change (trainfast/oom.py, as the Trainer says it).

When the measured steps end, the candidate fixes (mixed precision, or float32 where the script autocasts,
channels_last, another intra-op thread count: on 2 CPUs a compute-heavy step can take 1.8x as long on one thread,
which turns "more workers" into a slowdown) are timed on a copy of the script's model (the model itself, put back,
where it cannot be copied) and its first training input (probe.py), within half the budget left; the report ranks them
by those figures.

Under torchrun (2+ ranks, each running the doctor) no rank stops on its own clock: one that stopped alone would
leave its peers in an all-reduce it never joins (a hang until the collective's timeout, or a crash when its
connection drops). A rank that wants to stop (steps measured, deadline passed, SIGALRM) proposes a step a little
ahead on torchrun's store under its own key prefix; every rank reads the store every `STOP_CHECK_EVERY` steps
and all stop at the step first proposed (timeline.py says why that step is reached by all). Why the store: it
needs nothing from the script's process group (a collective of ours on it could interleave with DDP's own and
deadlock), costs one round trip every few steps instead of a collective per step, and torchrun's agent hosts it
for the job's whole life. A rank that is still running `_grace_s` after its SIGALRM is stuck, and stops alone.

The report reads `cudnn.benchmark` as the script had it when its measured steps ended (or, stopped before, when it
ended): torch_settings() puts back the value from before the script, and a script that set it (or one that sets it
and puts it back on its way out, which the doctor's stop unwinds through) would be told to set it.
"""

from __future__ import annotations

import gc
import logging
import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from trainfast.diagnose.capture.attempts import agent_store, attempt_of, lost_progress, record_for, restarts_left
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.probe_hook import gain_probe
from trainfast.diagnose.capture.script import (
    _alarm,
    _end_process_group,
    _failed_step,
    _model_device,
    _oom_entry,
    _own_setup_s,
    _process_group_up,
    _process_start,
)
from trainfast.diagnose.capture.snapshot import snapshot
from trainfast.diagnose.capture.stop import _RUNS, StoreStop, launched_ranks, rank_agreement
from trainfast.diagnose.capture.timeline import MEASURE, StopMeasuring, Timeline
from trainfast.diagnose.capture.whole_trials import WholeRun, copy_bandwidth, eval_trial
from trainfast.diagnose.evidence.evidence import evidence_of
from trainfast.diagnose.evidence.wholerun import account
from trainfast.diagnose.fixes.input import num_workers
from trainfast.diagnose.fixes.model import cpu_threads_beside_workers
from trainfast.diagnose.fixes.run import MIN_SHARE
from trainfast.diagnose.report.build import build
from trainfast.diagnose.report.job import job_report
from trainfast.diagnose.report.report import Report
from trainfast.dynamo import dynamo_counts
from trainfast.envcheck.environment import environment, loader_settings, preflight
from trainfast.launch import launch_env
from trainfast.loader.prefetch import InputTransform, move
from trainfast.monitor import Monitor
from trainfast.oom import is_oom
from trainfast.samples import batch_samples
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.step import TrainStep, default_batch_loss, forward_backward

if TYPE_CHECKING:
    from trainfast.diagnose.capture.instrument import Instrumentation


log = logging.getLogger("trainfast.diagnose")


@dataclass(frozen=True)
class DoctorRun:
    report: Report
    exit_code: int  # the script's own: 0 when it finished or was stopped after enough steps
    error: str | None  # the script's traceback, when it crashed
    # Under torchrun: rank 0's `report` is the job's (every rank's figures, ranks.py); another rank's is its own,
    # `published` when its figures reached rank 0 through the job's store.
    rank: int = 0
    world_size: int = 1
    published: bool = False


# Long enough for a slow start (dataset indexing, compilation) and 35 steps of a second each.
DEFAULT_MAX_SECONDS = 300.0


def run_doctor(target: str, *, module: bool = False, args: list[str] | None = None, steps: int = 30,
               warmup: int = 5, max_seconds: float | None = DEFAULT_MAX_SECONDS,
               monitor_interval_s: float = 0.5, probe_gains: bool = True, whole_run: bool = False,
               from_process_start: bool = False) -> DoctorRun:
    """Run `target` (a script path, or a module name with `module=True`) and measure `steps` steps, stopping it
    after `max_seconds` of wall time whatever it has measured by then (None: no limit). `probe_gains=False` skips
    timing the candidate fixes on a copy of the model (a `--verify` run measures the fix itself). `whole_run`: the
    script runs on after the measured steps, to its end (or `max_seconds`), and the report accounts for all of it
    (wholerun.py): from the process's start with `from_process_start` (the CLI: the interpreter and the imports are
    the script's start-up too), else from this call."""
    entered = time.perf_counter()
    if not module and not Path(target).is_file():
        raise FileNotFoundError(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds={max_seconds!r}: give a positive number of seconds, or None for no limit")
    timeline = Timeline(warmup_steps=warmup, max_steps=steps)
    timeline.stop_when_done = not whole_run
    ledger = record = None
    run = next(_RUNS)
    if whole_run:
        ledger = Ledger(process_start=_process_start(entered) if from_process_start else entered)
        if from_process_start:  # importing the doctor itself is not the script's start-up
            ledger.doctor(_own_setup_s(entered), "set-up", end=entered)
        store = agent_store()  # under torchrun with --max-restarts: this attempt's record (attempts.py)
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

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    distributed_before = _process_group_up()
    exit_code, error, outcome = 0, None, "the script ended"
    # An optimizer's constructor imports torch._dynamo, which keeps a table of Tensor's methods: imported while
    # our counting wrappers are in place, it would keep them (and the whole run) for the rest of the process.
    import torch._dynamo
    oom: dict[str, Any] | None = None
    # torch_settings() puts back the thread count, cudnn.benchmark and TF32 the script may change
    with torch_settings(), Monitor(interval_s=monitor_interval_s) as monitor, \
            Instrumentation(timeline, on_loader=on_loader, ledger=ledger) as inst:
        # The candidate fixes, timed on a copy of the model when the measured steps end (probe.py). Under torchrun
        # too: a replay holds no collective, so a rank that takes longer only delays its peers' next all-reduce.
        probe = _gain_probe(timeline, inst) if probe_gains else None
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
            with _alarm(remaining, timeline):
                sys.argv = [target, *(args or [])]
                if module:
                    sys.path[0:0] = [os.getcwd()]  # what `python -m` puts first
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    sys.path[0:0] = [str(Path(target).resolve().parent)]  # what `python script.py` puts first
                    runpy.run_path(target, run_name="__main__")
            outcome = "the script finished"
        except StopMeasuring as stop:
            measured = len(timeline.records)
            if stop.reason == "budget":
                outcome = (f"stopped at the {max_seconds:g} s budget (--max-seconds) after {measured} measured "
                           f"step(s) ({warmup} warm-up)")
            else:
                outcome = f"stopped after {measured} measured steps ({warmup} warm-up)"
            if agreement is not None and agreement.asked_by is not None:
                outcome += (f"; all {launched_ranks()} ranks stopped at the same step ({timeline.closed_steps}, "
                            f"counted from the script's start), as rank {agreement.asked_by} proposed")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            exit_code, outcome = code, f"the script called sys.exit({e.code!r})"
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)  # as Python prints sys.exit("message") on the way out
        except KeyboardInterrupt:
            exit_code, outcome = 130, "interrupted (Ctrl-C)"
        except Exception as e:
            exit_code, outcome = 1, f"the script crashed: {type(e).__name__}: {e}"
            error = "".join(traceback.format_exception(e))
            if is_oom(e):  # now, before the failed step's tensors go with the exception's frames
                oom = _oom_entry(e, _model_device(inst.observed))
        finally:
            ended = time.perf_counter()
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.environ.clear()
            os.environ.update(saved_env)
            timeline.finish()
            if record is not None:  # after finish(): the step the run ended in is closed
                record.end(outcome)
            timeline.agreement = None  # (its store connection goes with it)
            script_benchmark = measured_benchmark[0] if measured_benchmark else torch.backends.cudnn.benchmark
        gc.collect()  # the unwound script's loaders (and their worker processes) go now, not at exit
    whole = None if ledger is None else whole_run_entry(ledger, inst, end=ended, warmup=warmup)
    if whole is not None:  # after torchrun restarted the job (attempts.py)
        whole.lost = whole.entry["lost_progress"] = None if record is None else lost_progress(
            record.store, attempt=attempt_of(), run=run, started=record.ledger.process_start + record.to_unix)
    try:
        return _report(timeline, inst, monitor, checks=checks, target=target, module=module, args=args,
                       outcome=outcome, exit_code=exit_code, error=error, oom=oom, steps=steps,
                       script_benchmark=script_benchmark, agreement=agreement, whole=whole)
    finally:
        # After the job's report: without torchrun's agent, rank 0's process group hosts the store the ranks
        # send their figures through
        if not distributed_before:
            _end_process_group()


def _report(timeline: Timeline, inst: Instrumentation, monitor: Monitor, *, checks: list[dict[str, Any]],
            target: str, module: bool, args: list[str] | None, outcome: str, exit_code: int, error: str | None,
            oom: dict[str, Any] | None, steps: int, script_benchmark: bool,
            agreement: StoreStop | None, whole: WholeRun | None = None) -> DoctorRun:
    """The run's report; under torchrun, rank 0's is the job's (ranks.py), the others send theirs."""
    env = environment()
    env["checks"] = [*env.get("checks", []), *checks]
    script = {"target": f"-m {target}" if module else target, "args": list(args or []), "outcome": outcome,
              "exit_code": exit_code, "error": error}
    if oom is not None:
        oom["step"] = _failed_step(timeline)
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


def _forward_backward(model: nn.Module, loader: Any) -> TrainStep:
    """The default step for `diagnose(loader, model=...)`: forward, the Trainer's default loss
    (`trainfast.trainer.step.default_batch_loss`: `(inputs, targets)` pairs and Hugging Face style mappings), backward.
    A pair's inputs get the loader's normalisation (trainfast loaders yield uint8 images) as in the Trainer; a
    mapping is moved to the model's device as it is."""
    device = next(model.parameters()).device
    transform = InputTransform(device, getattr(loader, "normalize", None), channels_last=False)

    def step(batch: Any) -> None:
        batch = move(batch, device) if isinstance(batch, Mapping) else transform(move(batch, device))
        forward_backward(model, batch, default_batch_loss, nullcontext())
        model.zero_grad(set_to_none=True)
    return step


def _loader_rate(loader: Iterable[Any], batches: int, warmup: int) -> float | None:
    """Samples/s of the loader replayed alone (after `warmup` batches), or None if it ran dry.

    A batch's samples are the leading dimension of its first tensor (`trainfast.samples.batch_samples`), dict
    and nested batches alike."""
    seen, samples, started = 0, 0, 0.0
    for batch in loader:
        seen += 1
        if seen == warmup:
            started = time.perf_counter()
        elif seen > warmup:
            samples += batch_samples(batch)
            if seen >= warmup + batches:
                break
    elapsed = time.perf_counter() - started
    return samples / elapsed if seen > warmup and elapsed > 0 else None


def diagnose(loader: Iterable[Any], step_fn: TrainStep | None = None, *, model: nn.Module | None = None,
             steps: int = 30, warmup: int = 5, replay: bool = True) -> Report:
    """Measure `steps` training steps of `step_fn(batch)` fed by `loader` (after `warmup`) and report.

    Without `step_fn`, `model` gets a forward + backward step. With `replay`, the loader is first timed
    alone: how much faster it is than training is the strongest input-bound signal there is. Without a
    step at all, only the loader is measured and there is no verdict.

    The `model=` step's loss is the Trainer's default (`trainfast.trainer.step.default_batch_loss`):
    `(inputs, targets)` batches take cross-entropy against class indices or probabilities, else the mean squared
    error; Mapping batches, Hugging Face style, go to the model's device and in as keyword arguments,
    `model(**batch)`, less `labels` unless `model.forward` has a `labels` parameter, and the loss is the
    output's `loss` when there is one, else the cross-entropy (`ignore_index=-100`) of the logits against integer
    `labels`, else their mean. A batch's samples are the leading dimension of its first tensor, depth first
    (`trainfast.samples.batch_samples`).

    >>> report = trainfast.diagnose(loader, model=model)   # doctest: +SKIP
    >>> report.render()                                    # doctest: +SKIP
    """
    if step_fn is None and model is not None:
        step_fn = _forward_backward(model, loader)
    notes: list[str] = []
    loader_rate = _loader_rate(loader, steps, warmup) if replay and step_fn is not None else None
    timeline = Timeline(warmup_steps=warmup, max_steps=steps, explicit_steps=True)
    with torch_settings(), Monitor() as monitor, Instrumentation(timeline) as inst:
        if step_fn is not None:
            timeline.on_phase_end = _gain_probe(timeline, inst)
        while not timeline.done:
            fetched = 0
            for batch in loader:
                fetched += 1
                if step_fn is not None:
                    step_fn(batch)
                inst.end_step()
                if timeline.done:
                    break
            if fetched == 0:
                notes.append("the loader yielded no batch")
                break
    records = timeline.records
    seconds, samples = sum(r.total_s for r in records), sum(r.samples for r in records)
    headroom = loader_rate * seconds / samples if loader_rate and samples and seconds else None
    # Replay headroom says something only for a loader that runs beside training (workers): without workers,
    # loading is part of every step and headroom is just 1 / (1 - data wait).
    asynchronous = (loader_settings(loader)[0] or 0) > 0
    script: dict[str, Any] = {"target": "diagnose()", "loader_samples_per_s": loader_rate, "loader_headroom": headroom}
    report = build_report(timeline, inst, monitor=monitor, env=environment(), notes=notes, script=script,
                          loader_headroom=headroom if asynchronous else None)
    if step_fn is None:
        report.verdict = None
        report.recommendations = []
        report.notes.append("no step_fn or model: only the loader was measured"
                            + (f" ({report.samples_per_s:,.0f} samples/s)" if report.samples_per_s else ""))
    return report


class Doctor:
    """Measure an existing loop: `with Doctor() as doctor: <train>`; then `doctor.report`.

    Steps are found as the zero-code doctor finds them (an iteration's optimizer steps, else its backward
    passes; see timeline.py); the first `warmup` are not measured. Nothing is stopped early.
    """

    def __init__(self, *, warmup: int = 5, monitor_interval_s: float = 0.5) -> None:
        self.timeline = Timeline(warmup_steps=warmup)
        self._monitor = Monitor(interval_s=monitor_interval_s)
        self._inst = Instrumentation(self.timeline)
        self.report: Report | None = None

    def __enter__(self) -> Doctor:
        self._monitor.start()
        try:
            self._inst.__enter__()
        except BaseException:
            self._monitor.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._inst.__exit__(*exc)
        self._monitor.stop()
        self.report = build_report(self.timeline, self._inst, monitor=self._monitor, env=environment(),
                                   script={"target": "Doctor()"})


def whole_run_entry(ledger: Ledger, instrumentation: Instrumentation, *, end: float, warmup: int) -> WholeRun:
    """Account for the run that ended at `end` (perf_counter), then time what its fixes need (after the script: the
    doctor's time, not the script's)."""
    observed = instrumentation.observed
    compiled = observed.compiled_model or dynamo_counts().get("frames", 0) > observed.dynamo_at_start.get("frames", 0)
    entry = account(ledger, end=end, compiled=compiled, warmup=warmup)
    share = {p["phase"]: p["share"] for p in entry["phases"]}
    trial = eval_trial(ledger, tuple(sorted(observed.autocast))) if share["evaluation"] >= MIN_SHARE else None
    if trial is not None:
        entry["evaluation"]["trial"] = trial.to_json()
    ledger.eval_call = None
    bandwidth = copy_bandwidth() if entry["checkpoint"]["blocking_s"] > 0 else None
    return WholeRun(entry, trial, bandwidth, ledger=ledger, end=end, compiled=compiled, warmup=warmup)


def build_report(timeline: Timeline, instrumentation: Instrumentation, **what: Any) -> Report:
    """The report of what the hooks measured: the run frozen (capture/snapshot.py), then the report made from that
    capture alone (report/build.py). `what`: the rest of the capture (`snapshot`'s keywords)."""
    return build(snapshot(timeline, instrumentation, **what))


def _gain_probe(timeline: Timeline, instrumentation: Instrumentation) -> Callable[[str], None]:
    """The probe (capture/probe_hook.py), timing the thread counts the fixes would propose on the CPU."""
    return gain_probe(timeline, instrumentation, lambda: _proposed_threads(timeline, instrumentation))


def _proposed_threads(timeline: Timeline, instrumentation: Instrumentation) -> set[int]:
    """The intra-op thread counts below the current one that a fix would propose on the CPU: the num_workers fix's,
    and the cpu_threads fix's (the cores the loader's workers leave): timed, so that each fix cites its trial (and
    cpu_threads is offered only where it measured faster)."""
    if not timeline.records:
        return set()
    evidence = evidence_of(snapshot(timeline, instrumentation, final=False))
    if evidence.device != "cpu":
        return set()
    fix = num_workers(evidence)
    proposed = {int(t) for t in [(fix.overrides or {}).get("threads") if fix is not None else None,
                                 cpu_threads_beside_workers(evidence)] if t is not None}
    return {t for t in proposed if t < evidence.threads}
