"""Progress: a rich bar on a terminal, a log line every few seconds otherwise.

The loop asks `due(now)` every optimizer step: one float comparison. Only when a refresh is due
(every 0.25 s for the bar, every `interval_s` for log lines) does it compute rates and, for a log
line, read the loss from the device. The bar shows the loss as last read: reading it every step would
synchronise the device.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

log = logging.getLogger("trainfast")
BAR_INTERVAL_S = 0.25

RATE_WINDOW = 50  # steps over which the progress display averages samples/s and data wait


class ProgressReporter:
    def __init__(self, *, enabled: bool, total_steps: int | None, interval_s: float, epochs: int,
                 tty: bool | None = None) -> None:
        self.total_steps, self.epochs = total_steps, epochs
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.enabled = enabled
        self.interval_s = BAR_INTERVAL_S if self.tty else interval_s
        self._next = 0.0 if self.tty else None
        self._bar: Progress | None = None
        self._task: Any = None
        self.loss: float | None = None
        self.loss_scale: float | None = None  # fp16's loss scale as last read (log points), when one is used

    def __enter__(self) -> ProgressReporter:
        if self.enabled and self.tty:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=Console(stderr=True), refresh_per_second=4)
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total_steps, stats="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None

    def due(self, now: float) -> bool:
        if not self.enabled:
            return False
        if self._next is None:  # the first log line comes one interval after the start
            self._next = now + self.interval_s
        return now >= self._next

    @property
    def wants_loss(self) -> bool:
        """A log line shows a fresh loss; the bar makes do with the last one read."""
        return not self.tty

    def show(self, now: float, *, step: int, epoch: int, samples_per_s: float, wait_fraction: float,
             mfu: float | None = None) -> None:
        if not self.enabled:
            return
        self._next = now + self.interval_s
        loss = f" | loss {self.loss:.4f}" if self.loss is not None else ""
        if self.loss_scale is not None:
            loss += f" | scale {self.loss_scale:g}"
        rate = f"{samples_per_s:,.0f} samples/s" + (f" (MFU {mfu:.1%})" if mfu is not None else "")
        stats = f"{rate} | data wait {wait_fraction:.0%}{loss}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=f"epoch {epoch + 1}/{self.epochs}", stats=stats)
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            log.info("epoch %d/%d step %d%s | %s", epoch + 1, self.epochs, step, total, stats)
