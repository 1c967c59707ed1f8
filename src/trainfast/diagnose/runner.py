"""The zero-code doctor: run an unmodified script or module under instrumentation, then report.

The script runs in this process through `runpy`, with its own `sys.argv` and `sys.path[0]` and as
`__main__` (so its `if __name__ == "__main__":` block runs and spawned DataLoader workers can re-import
it). After `warmup` optimizer steps, `steps` more are measured; then the optimizer hook raises
`StopMeasuring`, a BaseException the script's `except Exception:` cannot swallow, and the script
unwinds. Every patch is removed whatever happens: normal end, `sys.exit`, a crash, or the stop.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainfast.diagnose.instrument import Instrumentation
from trainfast.diagnose.report import Report, build_report
from trainfast.diagnose.timeline import StopMeasuring, Timeline
from trainfast.envcheck.environment import environment, preflight
from trainfast.monitor import Monitor
from trainfast.trainer.settings import torch_settings


@dataclass(frozen=True)
class DoctorRun:
    report: Report
    exit_code: int  # the script's own: 0 when it finished or was stopped after enough steps
    error: str | None  # the script's traceback, when it crashed


def run_doctor(target: str, *, module: bool = False, args: list[str] | None = None, steps: int = 30,
               warmup: int = 5, monitor_interval_s: float = 0.5) -> DoctorRun:
    """Run `target` (a script path, or a module name with `module=True`) and measure `steps` steps."""
    if not module and not Path(target).is_file():
        raise FileNotFoundError(f"no script at {target!r}; give a Python file, or -m MODULE for a module")
    timeline = Timeline(warmup_steps=warmup, max_steps=steps)
    timeline.stop_when_done = True
    checks: list[dict[str, Any]] = []
    seen_loaders: set[int] = set()

    def on_loader(loader: Any) -> None:  # the pre-flight, before each loader's first batch
        if id(loader) not in seen_loaders:
            seen_loaders.add(id(loader))
            checks.extend(c.to_json() | {"loader": len(seen_loaders) - 1} for c in preflight(loader)
                          if c.status in ("warn", "fail"))

    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    exit_code, error = 0, None
    # torch_settings() puts back the thread count, cudnn.benchmark and TF32 the script may change
    with torch_settings(), Monitor(interval_s=monitor_interval_s) as monitor, \
            Instrumentation(timeline, on_loader=on_loader) as inst:
        try:
            if module:
                sys.argv = [target, *(args or [])]
                sys.path[0:0] = [os.getcwd()]  # what `python -m` puts first
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, *(args or [])]
                sys.path[0:0] = [str(Path(target).resolve().parent)]  # what `python script.py` puts first
                runpy.run_path(target, run_name="__main__")
            outcome = "the script finished"
        except StopMeasuring:
            outcome = f"stopped after {len(timeline.records)} measured steps ({warmup} warm-up)"
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            exit_code, outcome = code, f"the script called sys.exit({e.code!r})"
        except KeyboardInterrupt:
            exit_code, outcome = 130, "interrupted (Ctrl-C)"
        except Exception as e:
            exit_code, outcome = 1, f"the script crashed: {type(e).__name__}: {e}"
            error = "".join(traceback.format_exception(e))
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.environ.clear()
            os.environ.update(saved_env)
        gc.collect()  # the unwound script's loaders (and their worker processes) go now, not at exit
    env = environment()
    env["checks"] = [*env.get("checks", []), *checks]
    script = {"target": f"-m {target}" if module else target, "args": list(args or []), "outcome": outcome,
              "exit_code": exit_code, "error": error}
    notes = []
    if len(timeline.records) < steps and "stopped" not in outcome:
        notes.append(f"only {len(timeline.records)} of the {steps} requested steps were measured before the script "
                     "ended; the figures are less certain")
    report = build_report(timeline, inst, monitor=monitor, env=env, script=script, notes=notes)
    return DoctorRun(report=report, exit_code=exit_code, error=error)
