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

import contextlib
import gc
import itertools
import logging
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch

from trainfast.diagnose.attempts import agent_store, attempt_of, lost_progress, record_for, restarts_left
from trainfast.diagnose.build import build_report
from trainfast.diagnose.instrument import Instrumentation, Observations
from trainfast.diagnose.ledger import Ledger
from trainfast.diagnose.probe_hook import gain_probe
from trainfast.diagnose.ranks import job_report
from trainfast.diagnose.report import Report
from trainfast.diagnose.runfixes import WholeRun, whole_run_entry
from trainfast.diagnose.timeline import MEASURE, StopMeasuring, Timeline
from trainfast.envcheck.environment import environment, preflight
from trainfast.launch import launch_env
from trainfast.monitor import Monitor
from trainfast.oom import advice, first_line, fragmented, is_oom, memory_at_oom, requested_bytes
from trainfast.trainer.distributed import RELEASE_S
from trainfast.trainer.settings import torch_settings

log = logging.getLogger("trainfast.diagnose.runner")


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
# Under torchrun: closed steps between two reads of the agreed stop step. A read is a round trip to the store in
# torchrun's agent process (50-100 us on this loaded 2-core machine): +9-14 us a step measured on a 50 us null step,
# where reading every step cost +46-100 us; ~1 % of a 1 ms DDP step on gloo. Every rank stops at most
# STOP_CHECK_EVERY + 3 steps after the one that asked.
STOP_CHECK_EVERY = 8
# Reaching torchrun's store: the agent's is up before the script starts; without one (TORCHELASTIC_USE_AGENT_STORE
# unset), rank 0's process group hosts it, which the script starts before its first step.
STORE_CONNECT_S = 30.0
# After its SIGALRM, a rank waits this long (at least; 4x the agreed steps' time when longer) for the agreed step
# before it takes itself for stuck and stops alone.
STUCK_GRACE_S = 30.0
STOP_KEY = "stop"
_RUNS = itertools.count()  # doctor runs in this process: each gets its own keys on the store (every rank counts alike)


class StoreStop:
    """A `StopAgreement` (timeline.py) on a store every rank reaches: the first rank to propose sets the stop
    (`compare_set` on an absent key: one atomic round trip), every rank reads that one. A store that fails is given
    up, logged once: the rank then stops alone, as a single process does."""

    check_every = STOP_CHECK_EVERY

    def __init__(self, connect: Callable[[], Any], rank: int) -> None:
        self._connect, self.rank = connect, rank
        self._store: Any = None
        self._failed = False
        self.asked_by: int | None = None  # the rank whose proposal every rank follows

    def connect(self) -> bool:
        return self._call(lambda store: b"ok") is not None

    def propose(self, step: int, reason: str) -> tuple[int, str] | None:
        return self._parse(self._call(lambda store: store.compare_set(STOP_KEY, "", f"{step} {self.rank} {reason}")))

    def agreed(self) -> tuple[int, str] | None:
        return self._parse(self._call(lambda store: store.get(STOP_KEY) if store.check([STOP_KEY]) else None))

    def store(self) -> Any:
        """The job's store under this run's prefix (connected, or connecting now: may raise), for what the ranks
        send each other after the run (ranks.py); None when it already failed during the run."""
        if self._failed:
            return None
        if self._store is None:
            self._store = self._connect()
        return self._store

    def _call(self, operation: Callable[[Any], bytes | None]) -> bytes | None:
        if self._failed:
            return None
        try:
            if self._store is None:
                self._store = self._connect()
            return operation(self._store)
        except Exception as e:  # DistStoreError, DistNetworkError, a timeout: the job's store is out of reach
            self._failed = True
            log.warning("doctor: rank %d cannot use torchrun's store (%s: %s): it stops on its own clock and step "
                        "count, and a rank still inside a collective then may hang until its timeout",
                        self.rank, type(e).__name__, e)
            return None

    def _parse(self, value: bytes | None) -> tuple[int, str] | None:
        if not value:
            return None
        step, rank, reason = value.decode().split(" ", 2)
        self.asked_by = int(rank)
        return int(step), reason


def launched_ranks(env: Mapping[str, str] | None = None) -> int:
    """The job's world size when this process is a rank launched by torchrun (TORCHELASTIC_RUN_ID) or another
    launcher giving 2+ ranks their RANK / WORLD_SIZE; 0 for a process on its own (RANK=0 WORLD_SIZE=1 set by
    hand, for a script that initialises a process group from the environment, is one)."""
    env = os.environ if env is None else env
    try:
        world = launch_env(env).world_size
    except ValueError:  # malformed: the script's own launch fails with its own message, not the doctor's
        world = 1
    return world if "TORCHELASTIC_RUN_ID" in env or world > 1 else 0


def rank_agreement(env: Mapping[str, str] | None = None, *, run: int | None = None) -> StoreStop | None:
    """The stop agreement of a job with 2+ ranks, on its store (MASTER_ADDR:MASTER_PORT, torchrun's agent store
    when TORCHELASTIC_USE_AGENT_STORE=True), under a key prefix of ours per attempt and doctor run; None for a
    single process or without a store address."""
    env = os.environ if env is None else env
    if launched_ranks(env) < 2 or not torch.distributed.is_available():
        return None
    try:
        host, port, rank = env["MASTER_ADDR"], int(env["MASTER_PORT"]), launch_env(env).rank
    except (KeyError, ValueError) as e:
        log.warning("doctor: %d ranks but no store to agree on a stop step through (%s: %s): each rank stops on "
                    "its own clock", launched_ranks(env), type(e).__name__, e)
        return None
    # a restarted attempt must not read the stop of the attempt before it
    run = next(_RUNS) if run is None else run
    prefix = f"trainfast/doctor/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/run_{run}/"

    def connect() -> Any:
        client = torch.distributed.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                                            timeout=timedelta(seconds=STORE_CONNECT_S), wait_for_workers=False)
        return torch.distributed.PrefixStore(prefix, client)  # type: ignore[attr-defined]
    agreement = StoreStop(connect, rank)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agreement.connect()  # up already: a failure shows now, not mid-run
    return agreement


def _grace_s(timeline: Timeline) -> float:
    """How long a rank that proposed its stop from SIGALRM waits for the agreed step before stopping alone: the
    agreed step is at most `check_every + 3` steps away."""
    recent = [r.total_s for r in timeline.records[-20:]]
    checks = timeline.agreement.check_every if timeline.agreement is not None else 0
    return max(STUCK_GRACE_S, 4 * (checks + 3) * (max(recent) if recent else 0.0))


@contextmanager
def _alarm(seconds: float | None, timeline: Timeline) -> Iterator[None]:
    """Stop the script after `seconds` wherever it is (SIGALRM, in the main thread): raise StopMeasuring("budget");
    under a stop agreement, propose the stop to the other ranks instead, and raise only if this rank is still
    running `_grace_s` later (stuck). A no-op off the main thread or without SIGALRM, where the step boundaries
    still check the deadline."""
    if seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    proposed = False

    def stop(signum: int, frame: object) -> None:
        nonlocal proposed
        if timeline.agreement is None or proposed:
            raise StopMeasuring("budget")
        proposed = True
        timeline.request_stop("budget")  # raises when no agreement can be reached
        signal.setitimer(signal.ITIMER_REAL, _grace_s(timeline))
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
        probe = gain_probe(timeline, inst) if probe_gains else None
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


def _process_start(now: float) -> float:
    """The process's start on the perf_counter clock (`now` is perf_counter's reading now): a whole run's start-up
    counts from there (the interpreter, importing torch)."""
    age = time.time() - float(psutil.Process().create_time())
    return now - max(0.0, age)


def _own_setup_s(entered: float) -> float:
    """The doctor's own start-up until `entered` (perf_counter): from trainfast's import, less the `import torch`
    inside it, to the doctor's start (its modules, the command line)."""
    from trainfast import _import_clock
    return max(0.0, entered - _import_clock.STARTED - _import_clock.TORCH_S)


def _process_group_up() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _end_process_group() -> None:
    """A process group the stopped script created (its `destroy_process_group()` never ran): end it, or its
    rendezvous port stays bound and `--verify`'s runs of the script fail with EADDRINUSE."""
    if _process_group_up():
        # gloo's worker threads let go of the last collective's tensors after it returns, with the GIL: destroyed
        # before, the group's destructor joins them holding it (trainer/distributed.py's process_group)
        time.sleep(RELEASE_S)
        with contextlib.suppress(Exception):  # a group already broken: nothing more to free
            torch.distributed.destroy_process_group()


def _model_device(observed: Observations) -> torch.device | None:
    """The device the model was seen on; without one, the current CUDA device when the process did CUDA work
    (asking otherwise would create a CUDA context), else None (no allocator to read)."""
    if observed.device == "cuda":
        index = observed.device_index
        return torch.device("cuda") if index is None else torch.device("cuda", index)  # no index: the current one
    if observed.device is not None:
        return torch.device(observed.device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None


def _oom_entry(error: BaseException, device: torch.device | None) -> dict[str, Any]:
    """The report's `oom` entry (its `step` is filled in once the timeline is closed)."""
    try:
        memory = memory_at_oom(device) if device is not None else None
    except Exception:  # a device that cannot say: the advice without the allocator's numbers, not a second crash
        memory = None
    return {"message": first_line(error), "step": None, "device": None if device is None else str(device),
            "allocated_bytes": memory.allocated if memory else None,
            "reserved_bytes": memory.reserved if memory else None, "total_bytes": memory.total if memory else None,
            "fragmented": memory is not None and fragmented(memory, requested_bytes(str(error))),
            "advice": advice(error, memory)}


def _failed_step(timeline: Timeline) -> int | None:
    """The training step the error happened in (1-based, counted as the report counts steps: warm-up included),
    or None when it came before the first one began (loading data, building the model)."""
    if not (timeline.training_forwards or timeline.backwards or timeline.loader_fed):
        return None
    return timeline.steps_seen + 1
