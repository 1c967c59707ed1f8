"""`Timeline`: each optimizer step's wall time split into data wait, transfer, host overhead and compute.

Filled by the instrumentation hooks (see instrument.py); a step ends when an optimizer step ends.
- data wait: time blocked in a loader's `next()`;
- transfer: time blocked in host-to-device copies (`.to("cuda")`, `.cuda()`), visible only where the
  script makes them;
- host: the gap between the end of one optimizer step and the next batch request (logging, metrics,
  checkpoints), less the time spent waiting for the device in syncs such as `.item()`, which is the
  device's compute and counted as such;
- compute: the rest (forward, backward, optimizer step, device waits).
A step during which a batch was fetched with gradients off (a validation pass between two optimizer steps)
is not a training step's cost: it is left out and counted in `evaluation_steps`.
The hooks only add floats and append a tuple per step (~1 us); nothing synchronises the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    end_s: float  # seconds since the timeline started
    total_s: float
    wait_s: float
    transfer_s: float
    host_s: float
    samples: int
    syncs: int

    @property
    def compute_s(self) -> float:
        return max(0.0, self.total_s - self.wait_s - self.transfer_s - self.host_s)


class StopMeasuring(BaseException):
    """Raised from the optimizer hook once enough steps are measured; a BaseException so that a script's
    `except Exception:` cannot swallow it."""


class Timeline:
    def __init__(self, *, warmup_steps: int = 5, max_steps: int | None = None) -> None:
        if warmup_steps < 0 or (max_steps is not None and max_steps < 1):
            raise ValueError(f"warmup_steps={warmup_steps}, max_steps={max_steps}: need warmup_steps >= 0 and "
                             "max_steps >= 1 (or None for no limit)")
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.started = time.perf_counter()
        self.steps_seen = 0
        self.evaluation_steps = 0  # measured-range steps left out because they spanned an evaluation pass
        self.stop_when_done = False  # set by the zero-code runner: raise StopMeasuring at max_steps
        self._rows: list[tuple[float, float, float, float, float, int, int]] = []  # measured steps, as tuples
        self._step_start = self.started
        self._wait = self._transfer = self._gap_sync_wait = 0.0
        self._samples = self._syncs = 0
        self._first_ask: float | None = None
        self._evaluated = False

    # ---- called by the hooks: keep them lean, they run every step
    def fetched(self, asked: float, got: float, samples: int) -> None:
        if self._first_ask is None:
            self._first_ask = asked
        self._wait += got - asked
        self._samples += samples

    def evaluation_fetch(self) -> None:
        """A batch fetched with gradients off: this step spans an evaluation pass."""
        self._evaluated = True

    def transferred(self, seconds: float) -> None:
        self._transfer += seconds

    def synced(self, seconds: float) -> None:
        self._syncs += 1
        if self._first_ask is None:  # inside the host gap: it waited for the device, not for Python
            self._gap_sync_wait += seconds

    def step_end(self) -> None:
        now = time.perf_counter()
        self.steps_seen += 1
        if self._evaluated and self.steps_seen > self.warmup_steps:
            self.evaluation_steps += 1
        elif self.steps_seen > self.warmup_steps:
            start, first_ask = self._step_start, self._first_ask
            host = (first_ask - start - self._gap_sync_wait) if first_ask is not None else 0.0
            self._rows.append((now - self.started, now - start, self._wait, self._transfer, max(0.0, host),
                               self._samples, self._syncs))
        self._step_start = now
        self._wait = self._transfer = self._gap_sync_wait = 0.0
        self._samples = self._syncs = 0
        self._first_ask = None
        self._evaluated = False
        if self.stop_when_done and self.max_steps is not None and len(self._rows) >= self.max_steps:
            raise StopMeasuring

    # ---- read when reporting
    @property
    def records(self) -> list[StepRecord]:
        return [StepRecord(*row) for row in self._rows]

    @property
    def done(self) -> bool:
        return self.max_steps is not None and len(self._rows) >= self.max_steps
