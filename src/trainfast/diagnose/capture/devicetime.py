"""`DeviceTimer`: CUDA events on the device the work runs on, read once, at report time.

Why events: the host's clock sees when a call returned, not what the device did. A blocking copy from pageable
memory first waits for every kernel queued before it, so its host time is mostly the previous step's compute;
events recorded on the copy's stream bracket the copy alone. A step's pair of events (first input, end of its
work) gives the GPU time of the step. Recording costs a few microseconds and never synchronises; the events are
read after one synchronize per device, when the report is made.

Why lazily: recording an event on a device creates its CUDA context (hundreds of MB of device memory and a
noticeable start-up), and `Event.record()` without a stream records on the *current* device, which need not be
the model's. So nothing is created or recorded until CUDA work is seen: the model's parameters on a CUDA device
(the step events go on that device's current stream), or a copy to one (its events go on the destination's
current stream). A CPU-only script on a GPU host creates no event at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (start, end) events of a step's work or of one copy: opaque to everything but this module
EventPair = tuple[Any, Any]


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


def _current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


class DeviceTimer:
    """Events on the model's CUDA device for each step, and on the destination device around each copy.

    `make_event` and `stream_of` stand in for `torch.cuda.Event(enable_timing=True)` and
    `torch.cuda.current_stream(device)` in tests.
    """

    def __init__(self, make_event: Callable[[], Any] | None = None,
                 stream_of: Callable[[torch.device], Any] | None = None) -> None:
        self._make = make_event or _cuda_event
        self._stream_of = stream_of or _current_stream
        self.device: torch.device | None = None  # the model's CUDA device once seen; None before and on the CPU
        self.settled = False  # the model itself was seen (on a CUDA device or not): stop looking
        self.pairs: list[EventPair] = []  # each measured step's (first input, end of its work)
        self._start: Any = None
        self._end: Any = None
        self._recorded_on: set[torch.device] = set()  # synchronised before any event is read
        self._unsynced = False

    # ---- where the work runs
    def saw_model(self, device: torch.device) -> None:
        """The model's parameters are on `device`: step events go on its current stream (none for a CPU model).
        The last word: the model may have moved since a tensor was seen."""
        self.settled = True
        self._use(device if device.type == "cuda" else None)

    def saw_tensor(self, device: torch.device) -> None:
        """A batch or copy landed on `device` before the model was seen: time the steps there meanwhile."""
        if not self.settled and self.device is None and device.type == "cuda":
            self._use(device)

    def _use(self, device: torch.device | None) -> None:
        if device != self.device:
            self._start = self._end = None  # a pair must not span two devices: elapsed_time would fail
            self.device = device

    # ---- a step's work (called by the hooks: cheap, no sync)
    def batch_ready(self) -> None:
        if self._start is None and self.device is not None:
            self._start = self._record(self._stream_of(self.device), self.device)

    def work_done(self) -> None:
        if self._start is not None and self.device is not None:
            self._end = self._record(self._stream_of(self.device), self.device)

    def step_closed(self, measured: bool) -> None:
        if measured and self._start is not None and self._end is not None:
            self.pairs.append((self._start, self._end))
        self._start = self._end = None

    # ---- one host-to-device copy
    def copy_started(self, device: torch.device) -> tuple[Any, Any, torch.device]:
        """An event on the current stream of `device`, where the copy is about to be queued."""
        stream = self._stream_of(device)
        return self._record(stream, device), stream, device

    def copy_ended(self, started: tuple[Any, Any, torch.device]) -> EventPair:
        start, stream, device = started
        return start, self._record(stream, device)

    def _record(self, stream: Any, device: torch.device) -> Any:
        event = self._make()
        event.record(stream)
        self._recorded_on.add(device)
        self._unsynced = True
        return event

    # ---- read at report time
    def seconds(self, pair: EventPair) -> float:
        """Device seconds between a pair's events; the first read synchronises every device recorded on."""
        if self._unsynced:
            for device in self._recorded_on:
                torch.cuda.synchronize(device)
            self._unsynced = False
        start, end = pair
        return float(start.elapsed_time(end)) / 1000

    def step_seconds(self) -> list[float]:
        return [self.seconds(pair) for pair in self.pairs]
