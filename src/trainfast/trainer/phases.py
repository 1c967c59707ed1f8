"""`RunPhases`: `Trainer.fit`'s own wall time, from its start until its result is made (the `on_fit_end` callbacks,
which receive it, come after), in the phases `trainfast doctor --whole-run` uses, so that a run can be judged by its
own report.

- `startup`: fit's set-up until the first training epoch's `iter()`: the restore, the process group, the A/B plan,
  the loaders' pre-flight, `on_fit_start`;
- `compile`: the steps during which torch.compile compiled frames (watched in the first steps and the A/Bs', where
  it compiles), their excess over the median step (data wait left out of both);
- `train`: the training steps, from each epoch's first batch to its last step's end (the device synchronised there,
  once an epoch), less `compile` and the log points' host work;
- `evaluation`: the validation passes, the validation loader's start-up included;
- `checkpoint`: the time training was blocked by its saves (`FitResult.checkpoint_blocked_s`);
- `epoch_start`: each training epoch's `iter()` to its first batch (worker start-up);
- `other`: the rest: log points after their loss read (callbacks, TensorBoard, the progress line), the MFU peak's
  measurement where the A/Bs settle it inside the loop (taken at set-up, it is start-up), callbacks between epochs,
  the wait at the end for the last checkpoint write, the shutdown (the loaders' workers).

Every interval is two `perf_counter` reads at a point the loop passes anyway: a step pays nothing more (training's
time is each epoch's span less the rare intervals carved from it), but for the first steps and the A/Bs', which
read dynamo's frame counter too, and one device sync an epoch. `other` is the wall time less the phases above, which
never overlap, so the phases add up to the wall time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

PHASES = ("startup", "compile", "train", "evaluation", "checkpoint", "epoch_start", "other")
# How the summary line names each phase that is not training
LABELS = {"startup": "set-up", "compile": "compile", "evaluation": "validation", "checkpoint": "checkpoints",
          "epoch_start": "epoch starts", "other": "other"}


class RunPhases:
    """The intervals of one `fit`, added up per phase as they end (module doc)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)  # measured: all but compile (from the steps) and other (the rest)
        self.startup_end: float | None = None

    def add(self, phase: str, since: float, now: float | None = None) -> float:
        """`phase` ran from `since` until `now` (read now if None); returns `now`."""
        now = time.perf_counter() if now is None else now
        self.seconds[phase] += now - since
        return now

    def aside(self, seconds: float) -> None:
        """`seconds` inside an epoch's training span were host work that is not training (a log point after its
        loss read, the progress line, the MFU peak's measurement): taken out of `train`, so they fall to `other`."""
        self.seconds["train"] -= seconds

    def epoch_begins(self) -> float:
        """A training epoch is about to call `iter()`: the first one ends start-up. Returns now."""
        now = time.perf_counter()
        if self.startup_end is None:
            self.startup_end = now
            self.seconds["startup"] = now - self.started
        return now

    def report(self, *, compile_s: float, end: float | None = None) -> dict[str, Any]:
        """`wall_s`, `goodput` (train's share) and `phases` (`phase`, `seconds`, `share`, in `PHASES` order), from
        fit's start to `end` (now). `compile_s` is taken out of train. Without a training epoch, all of fit is
        `other`."""
        end = time.perf_counter() if end is None else end
        wall = max(0.0, end - self.started)
        seconds = dict(self.seconds)
        if self.startup_end is None:
            seconds["startup"] = 0.0
        seconds["compile"] = min(max(0.0, compile_s), seconds["train"])
        seconds["train"] -= seconds["compile"]
        measured = sum(v for k, v in seconds.items() if k != "other")
        seconds["other"] = max(0.0, wall - measured)
        share = {k: (v / wall if wall > 0 else 0.0) for k, v in seconds.items()}
        return {"wall_s": wall, "goodput": share["train"],
                "phases": [{"phase": p, "seconds": seconds[p], "share": share[p]} for p in PHASES]}


def compile_excess(step_s: Sequence[float], wait_s: Sequence[float], compiling: Sequence[int], *,
                   warmup: int) -> float:
    """Seconds torch.compile added to the steps at the indexes `compiling` (those during which it compiled frames):
    each one's excess over the median step, data wait left out of both. The median is over the other steps after the
    first `warmup` (all the other steps where there are none after it); 0 with no other step to compare with."""
    marked = set(compiling)
    if not marked:
        return 0.0
    busy = [s - w for s, w in zip(step_s, wait_s, strict=False)]
    rest = [b for i, b in enumerate(busy) if i not in marked and i >= warmup] or \
        [b for i, b in enumerate(busy) if i not in marked]
    if not rest:
        return 0.0
    steady = statistics.median(rest)
    return sum(max(0.0, busy[i] - steady) for i in marked if i < len(busy))


def summary_line(whole_run: dict[str, Any]) -> str:
    """`whole run: 12.1 s, goodput 93.4 % (validation 5 %, set-up 1 %, ...)`: the phases other than training that took
    any time, largest first."""
    rest = sorted((p for p in whole_run["phases"] if p["phase"] != "train" and p["seconds"] > 0),
                  key=lambda p: -p["seconds"])
    parts = [f"{LABELS[p['phase']]} {_percent(p['share'])}" for p in rest]
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"whole run: {whole_run['wall_s']:.1f} s, goodput {whole_run['goodput']:.1%}".replace("%", " %") + detail


def _percent(share: float) -> str:
    """A share as "5 %" from 1 % up, "0.2 %" below, "<0.1 %" below that."""
    value = share * 100
    return f"{value:.0f} %" if value >= 0.95 else f"{value:.1f} %" if value >= 0.05 else "<0.1 %"
