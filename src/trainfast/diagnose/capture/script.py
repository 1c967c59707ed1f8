"""Running the script under the doctor (`run_script`): as `python script.py` or `python -m module` would, in this
process, as `__main__`, with its own `sys.argv` and `sys.path[0]`; stopped by the time budget (SIGALRM) or the
measured steps (`StopMeasuring`), and its end told in words: finished, stopped, `sys.exit`, Ctrl-C, a crash (with
where an out-of-memory error happened and what the allocator held). Also what the run needs around it: the
process's start, the doctor's own set-up, and the process group a stopped script left."""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from trainfast.diagnose.capture.observations import Observations
from trainfast.diagnose.capture.stop import launched_ranks
from trainfast.diagnose.capture.timeline import StopMeasuring, Timeline
from trainfast.oom import advice, first_line, fragmented, is_oom, memory_at_oom, requested_bytes
from trainfast.trainer.distributed import RELEASE_S


@dataclass(frozen=True)
class ScriptEnd:
    """How the script ended."""

    exit_code: int  # its own: 0 when it finished or the doctor stopped it after enough steps
    outcome: str  # in words, for the report
    error: str | None  # its traceback, when it crashed
    oom: dict[str, Any] | None  # the report's `oom` entry, when the crash was an out-of-memory error
    ended: float  # perf_counter time


def run_script(target: str, *, module: bool, args: list[str] | None, timeline: Timeline,
               observed: Observations, seconds: float | None, budget_s: float | None) -> ScriptEnd:
    """Run `target` to its end or its stop; `seconds`: the time left before SIGALRM stops it, `budget_s` the whole
    budget (for the words). `sys.argv`, `sys.path` and `os.environ` are put back however it ends."""
    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    exit_code, error, oom = 0, None, None
    try:
        with alarm(seconds, timeline):
            run_as_main(target, module=module, args=args or [])
        outcome = "the script finished"
    except StopMeasuring as stop:
        measured, warmup = len(timeline.records), timeline.warmup_steps
        if stop.reason == "budget":
            outcome = (f"stopped at the {budget_s:g} s budget (--max-seconds) after {measured} measured "
                       f"step(s) ({warmup} warm-up)")
        else:
            outcome = f"stopped after {measured} measured steps ({warmup} warm-up)"
        agreement = timeline.agreement
        asked_by = getattr(agreement, "asked_by", None)
        if asked_by is not None:
            outcome += (f"; all {launched_ranks()} ranks stopped at the same step ({timeline.closed_steps}, "
                        f"counted from the script's start), as rank {asked_by} proposed")
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
            oom = oom_entry(e, model_device(observed))
    finally:
        ended = time.perf_counter()
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    return ScriptEnd(exit_code, outcome, error, oom, ended)


def run_as_main(target: str, *, module: bool, args: list[str]) -> None:
    """`target` run as `python target ARGS` (`python -m target ARGS`) would: in this process as `__main__`, with its
    own `sys.argv` and `sys.path[0]`. The caller puts those (and `os.environ`) back, and reads how it ended."""
    sys.argv = [target, *args]
    if module:
        sys.path[0:0] = [os.getcwd()]  # what `python -m` puts first
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0:0] = [str(Path(target).resolve().parent)]  # what `python script.py` puts first
        runpy.run_path(target, run_name="__main__")


# After its SIGALRM, a rank waits this long (at least; 4x the agreed steps' time when longer) for the agreed step
# before it takes itself for stuck and stops alone.
STUCK_GRACE_S = 30.0


def _grace_s(timeline: Timeline) -> float:
    """How long a rank that proposed its stop from SIGALRM waits for the agreed step before stopping alone: the
    agreed step is at most `check_every + 3` steps away."""
    recent = [r.total_s for r in timeline.records[-20:]]
    checks = timeline.agreement.check_every if timeline.agreement is not None else 0
    return max(STUCK_GRACE_S, 4 * (checks + 3) * (max(recent) if recent else 0.0))


@contextmanager
def alarm(seconds: float | None, timeline: Timeline) -> Iterator[None]:
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


def process_start(now: float) -> float:
    """The process's start on the perf_counter clock (`now` is perf_counter's reading now): a whole run's start-up
    counts from there (the interpreter, importing torch)."""
    age = time.time() - float(psutil.Process().create_time())
    return now - max(0.0, age)


def own_setup_s(entered: float) -> float:
    """The doctor's own start-up until `entered` (perf_counter): from trainfast's import, less the `import torch`
    inside it, to the doctor's start (its modules, the command line)."""
    from trainfast import _import_clock
    return max(0.0, entered - _import_clock.STARTED - _import_clock.TORCH_S)


def process_group_up() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def end_process_group() -> None:
    """A process group the stopped script created (its `destroy_process_group()` never ran): end it, or its
    rendezvous port stays bound and `--verify`'s runs of the script fail with EADDRINUSE."""
    if process_group_up():
        # gloo's worker threads let go of the last collective's tensors after it returns, with the GIL: destroyed
        # before, the group's destructor joins them holding it (trainer/distributed.py's process_group)
        time.sleep(RELEASE_S)
        with contextlib.suppress(Exception):  # a group already broken: nothing more to free
            torch.distributed.destroy_process_group()


def model_device(observed: Observations) -> torch.device | None:
    """The device the model was seen on; without one, the current CUDA device when the process did CUDA work
    (asking otherwise would create a CUDA context), else None (no allocator to read)."""
    if observed.device == "cuda":
        index = observed.device_index
        return torch.device("cuda") if index is None else torch.device("cuda", index)  # no index: the current one
    if observed.device is not None:
        return torch.device(observed.device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None


def oom_entry(error: BaseException, device: torch.device | None) -> dict[str, Any]:
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


def failed_step(timeline: Timeline) -> int | None:
    """The training step the error happened in (1-based, counted as the report counts steps: warm-up included),
    or None when it came before the first one began (loading data, building the model)."""
    if not (timeline.training_forwards or timeline.backwards or timeline.loader_fed):
        return None
    return timeline.steps_seen + 1
