"""What the hooks share while the script runs: what they observed (`Observations`, read when the run is captured),
how a hook puts a patch in place (`Patch`), the protocol every hook follows (`Hook`), and what a hook may ask of the
instrumentation that holds them all (`Watching`: instrument.py's `Instrumentation`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainfast.diagnose.capture.comms import Collectives, CommTotals
from trainfast.diagnose.capture.devicetime import DeviceTimer
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.records.capture import Site
from trainfast.diagnose.records.steps import WorkerTotals
from trainfast.flops import FlopCounter

Patch = Callable[[Any, str, Any], Any]  # (owner, attribute, replacement) -> the original: undone on exit


class Hook(Protocol):
    def install(self, patch: Patch) -> None:
        """Put the hook's patches in place, through `patch`."""

    def uninstall(self) -> None:
        """Let go of what the hook kept of the script (its patches are undone by the instrumentation)."""


@dataclass
class Observations:
    """What the script was seen to use, read when the report is made."""

    device: str | None = None  # the model's device type: "cpu", "cuda", ...
    device_index: int | None = None  # torch's index of the model's CUDA device
    compiled_model: bool = False  # the model called in training is a torch.compile OptimizedModule
    parameters: int = 0
    parameter_dtypes: set[str] = field(default_factory=set)  # floating dtypes of the trained parameters
    conv_weights: int = 0
    conv_weights_channels_last: int = 0
    # conv weights whose strides fit both layouts (a depthwise (C, 1, k, k) kernel, a 1-channel input's): they say
    # nothing of the layout the script chose
    conv_weights_ambiguous: int = 0
    input_layout: str | None = None  # of the model's first 4-D input: "channels_last" or "contiguous"
    autocast: set[tuple[str, str]] = field(default_factory=set)  # (device, dtype) entered and enabled
    scaler_steps: int = 0
    scaler_found_inf: dict[str, torch.Tensor] = field(default_factory=dict)  # per device, summed on it
    # torch._dynamo's counters when instrumentation started, when the warm-up ended and when the measured steps
    # ended (empty: not taken yet)
    dynamo_at_start: dict[str, int] = field(default_factory=dict)
    dynamo_at_warmup: dict[str, int] = field(default_factory=dict)
    dynamo_at_end: dict[str, int] = field(default_factory=dict)
    # the loader workers' own account of their batches (worker_clock.py) when the warm-up and the measured steps ended
    workers_at_warmup: WorkerTotals | None = None
    workers_at_end: WorkerTotals | None = None
    # the collectives' totals (comms.py) when the warm-up and the measured steps ended
    comm_at_warmup: CommTotals | None = None
    comm_at_end: CommTotals | None = None
    jpeg_decoded_pixels: list[int] = field(default_factory=list)
    # where the script made or first used what the fixes change (capture/sites.py), by `Site.what`: the first of each
    sites: dict[str, Site] = field(default_factory=dict)
    syncs: int = 0
    threads: int = 0  # torch intra-op threads when training started
    # Filled when the measured steps end (probe_hook.py's gain_probe), not by the hooks. Here, not on the
    # Instrumentation: its attributes are read in every hook, and each one more slows them all (timeline.py)
    trials: Any = None  # the candidate fixes timed on the model (probe.py)
    flop_counter: FlopCounter | None = None  # counting the step after the measured ones
    flops_per_step: int | None = None
    flops_reason: str | None = None  # why no FLOPs were counted

    def scaler_skipped(self) -> int:
        """Optimizer steps the GradScaler skipped (reading it synchronises: report time only)."""
        return int(sum(int(t.item()) for t in self.scaler_found_inf.values()))


class Watching(Protocol):
    """The state the hooks share, and what they call on each other through it."""

    timeline: Timeline
    ledger: Ledger | None
    observed: Observations
    device_timer: DeviceTimer
    events: DeviceTimer | None  # the model's CUDA device's timer, once it is known to be one
    collectives: Collectives
    paused: bool  # the doctor's own work (its trials)
    fetching: bool  # inside a timed loader's next()
    scanning: bool  # the model is still being looked for
    _undo: list[Callable[[], None]]

    def _patch(self, owner: Any, name: str, replacement: Any) -> Any: ...

    def discover(self, trigger: str) -> None: ...

    def saw_batch(self, batch: Any) -> None: ...

    def evaluating(self) -> bool: ...

    def work_done(self) -> None: ...

    def doctor_time(self, seconds: float, what: str) -> None: ...
