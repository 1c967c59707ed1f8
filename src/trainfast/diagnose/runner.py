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

On the CPU, when the loader fix the doctor is about to propose would give the model step fewer intra-op
threads, a few more steps are measured at that thread count after the others (the "threads" phase): on 2 CPUs a
compute-heavy step can take 1.8x as long on one thread, which turns "more workers" into a slowdown.
"""

from __future__ import annotations

import contextlib
import gc
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

import torch

from trainfast.diagnose.instrument import Instrumentation, Observations
from trainfast.diagnose.report import Report, build_report, thread_probe
from trainfast.diagnose.timeline import StopMeasuring, Timeline
from trainfast.envcheck.environment import environment, preflight
from trainfast.monitor import Monitor
from trainfast.oom import advice, first_line, fragmented, is_oom, memory_at_oom, requested_bytes
from trainfast.trainer.settings import torch_settings


@dataclass(frozen=True)
class DoctorRun:
    report: Report
    exit_code: int  # the script's own: 0 when it finished or was stopped after enough steps
    error: str | None  # the script's traceback, when it crashed


# Long enough for a slow start (dataset indexing, compilation) and 35 steps of a second each.
DEFAULT_MAX_SECONDS = 300.0


@contextmanager
def _alarm(seconds: float | None) -> Iterator[None]:
    """Raise StopMeasuring("budget") in the main thread after `seconds`, wherever the script is (SIGALRM);
    a no-op off the main thread or without SIGALRM, where the step boundaries still check the deadline."""
    if seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise StopMeasuring("budget")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_doctor(target: str, *, module: bool = False, args: list[str] | None = None, steps: int = 30,
               warmup: int = 5, max_seconds: float | None = DEFAULT_MAX_SECONDS,
               monitor_interval_s: float = 0.5, probe_threads: bool = True) -> DoctorRun:
    """Run `target` (a script path, or a module name with `module=True`) and measure `steps` steps, stopping it
    after `max_seconds` of wall time whatever it has measured by then (None: no limit). `probe_threads=False`
    skips the extra steps at a proposed thread count (a `--verify` run measures the fix itself)."""
    if not module and not Path(target).is_file():
        raise FileNotFoundError(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds={max_seconds!r}: give a positive number of seconds, or None for no limit")
    timeline = Timeline(warmup_steps=warmup, max_steps=steps)
    timeline.stop_when_done = True
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
    exit_code, error = 0, None
    # An optimizer's constructor imports torch._dynamo, which keeps a table of Tensor's methods: imported while
    # our counting wrappers are in place, it would keep them (and the whole run) for the rest of the process.
    import torch._dynamo  # noqa: F401
    oom: dict[str, Any] | None = None
    # torch_settings() puts back the thread count, cudnn.benchmark and TF32 the script may change
    with torch_settings(), Monitor(interval_s=monitor_interval_s) as monitor, \
            Instrumentation(timeline, on_loader=on_loader) as inst:
        if probe_threads:
            timeline.on_phase_end = thread_probe(timeline, inst)  # torch_settings() puts the thread count back
        try:
            remaining = None if max_seconds is None else max(1e-3, started + max_seconds - time.perf_counter())
            with _alarm(remaining):
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
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.environ.clear()
            os.environ.update(saved_env)
            timeline.finish()
            if not distributed_before:
                _end_process_group()
        gc.collect()  # the unwound script's loaders (and their worker processes) go now, not at exit
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
    report = build_report(timeline, inst, monitor=monitor, env=env, script=script, notes=notes, oom=oom)
    return DoctorRun(report=report, exit_code=exit_code, error=error)


def _process_group_up() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _end_process_group() -> None:
    """A process group the stopped script created (its `destroy_process_group()` never ran): end it, or its
    rendezvous port stays bound and `--verify`'s runs of the script fail with EADDRINUSE."""
    if _process_group_up():
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
