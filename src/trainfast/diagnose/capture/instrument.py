"""Instrumentation for an unmodified training loop: the hooks installed on entry, every patch removed on exit.

The hooks, each an object that installs its patches through `Instrumentation._patch` (which undoes them all on exit,
also when the script raises) and lets go of what it kept of the script on `uninstall`:
- the loaders' (loader_hook.py): each iterator's `next()` timed, each epoch's worker start-up, the workers' own clock;
- the model's (model_hook.py): the root modules found and their forwards watched, the model's device, its layout;
- the steps' (step_hook.py): optimizer steps and backward passes, the signals that end a step (timeline.py);
- the tensors' (tensor_hook.py): host syncs, host-to-device copies, autocast, JPEG decodes;
- the collectives' across ranks (comms.py), once the script's process group is up;
- a whole run's ledger (ledger.py): evaluation passes, checkpoint writes, prints and sleeps.
They share what this object holds: the timeline they feed, what they observed (`Observations`), whether the doctor
itself is at work (`paused`: its trials) or inside a loader's `next()` (`fetching`), whether the model is still
being looked for (`scanning`), and the CUDA events of the model's device once it is known to be one (`events`).
Compilation is read from torch._dynamo's counters instead of patching `torch.compile`, which other libraries wrap
themselves, as differences between snapshots (instrumentation start, warm-up end, measured steps' end): what the
process compiled before, another model or an earlier run, is not this loop's. When the run ends, `snapshot` freezes
all of it into a `Capture`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainfast.diagnose.capture.comms import Collectives
from trainfast.diagnose.capture.devicetime import DeviceTimer
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.loader_hook import LoaderHook
from trainfast.diagnose.capture.mark_hook import MarkHook
from trainfast.diagnose.capture.model_hook import ModelHook
from trainfast.diagnose.capture.observations import Hook, Observations
from trainfast.diagnose.capture.resolve import device_of, machine_record, observed_record
from trainfast.diagnose.capture.step_hook import StepHook
from trainfast.diagnose.capture.tensor_hook import TensorHook
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.capture.window import _earliest, _Step
from trainfast.diagnose.records.capture import Capture, Site, TimelineRecord, loaders_of
from trainfast.dynamo import dynamo_counts
from trainfast.monitor import Monitor

if TYPE_CHECKING:
    from trainfast.diagnose.capture.whole_trials import WholeRun


class Instrumentation:
    """Install the hooks on entry, remove every one on exit (also when the script raises)."""

    def __init__(self, timeline: Timeline, *, time_transfers: bool | None = None,
                 on_loader: Callable[[Any], None] | None = None, device_timer: DeviceTimer | None = None,
                 ledger: Ledger | None = None) -> None:
        self.timeline = timeline
        self.ledger = ledger  # a whole run's (ledger.py): every step, evaluation pass, save, print and sleep
        self.fetching = False  # inside a timed loader's next()
        self.paused = False  # the doctor's own work (probe.py): the hooks pass it through
        self.scanning = True  # until the second scan (when the first step closes): hot paths skip discover()
        timeline.on_close = self._step_closed
        # CUDA events on the model's device; `events` is the timer once that device is known to be a CUDA one
        # (None before and on the CPU: the hot paths test it and skip)
        self.device_timer = device_timer or DeviceTimer()
        self.events: DeviceTimer | None = None
        self.observed = Observations()
        self._undo: list[Callable[[], None]] = []
        # collectives across ranks (comms.py): installed at a scan once the script's process group is up
        self.collectives = Collectives(timeline.communicated, lambda: self.paused)
        self.model = ModelHook(self)
        self.loader = LoaderHook(self, on_loader)
        self.steps = StepHook(self, self.model)  # its `losses`: the script's loss per step (losses.py)
        self.hooks: list[Hook] = [self.loader, self.steps, self.model, TensorHook(
            self, self.model, time_transfers=torch.cuda.is_available() if time_transfers is None else time_transfers),
            MarkHook(self)]
        # what the other hooks and the doctor call, bound once (the hot paths read them as attributes)
        self.loaders = self.loader.loaders
        self.worker_clock = self.loader.worker_clock
        self.stats_for = self.loader.stats_for
        self.last_calls = self.model.last_calls
        self.discover = self.model.discover
        self.saw_batch = self.model.saw_batch
        self.evaluating = self.model.evaluating

    # ---- patch bookkeeping
    def _patch(self, owner: Any, name: str, replacement: Any) -> Any:
        had_own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, replacement)

        def undo() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # fall back to the inherited attribute, exactly as before
        self._undo.append(undo)
        return original

    def __enter__(self) -> Instrumentation:
        try:
            if self.ledger is not None:
                self.ledger.steps_closed = lambda: self.timeline.closed_steps
                self.ledger.install(self._patch)
            for hook in self.hooks:
                hook.install(self._patch)
            self.observed.dynamo_at_start = dynamo_counts()
            if self.timeline.warmup_steps == 0:
                self.observed.dynamo_at_warmup = self.observed.dynamo_at_start
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ledger is not None:
            self.ledger.uninstall()
        self.timeline.finish()  # the last step, waiting for an iteration that will not come
        while self._undo:  # (after it: closing the last step may hook the model's class, a patch to take back too)
            self._undo.pop()()
        if not self.observed.dynamo_at_end:  # the measured steps ended with the run (no step limit, or too few)
            self.observed.dynamo_at_end = dynamo_counts()
            self.observed.workers_at_end = self.worker_clock.totals()
            self.observed.comm_at_end = self.collectives.totals(self.timeline.closed_steps)
        observed = self.observed
        if observed.flop_counter is not None:  # the run ended inside the counted step: a part of a step is no count
            observed.flop_counter.stop()
            observed.flop_counter, observed.flops_reason = None, "the script ended before the counted step did"
        for hook in self.hooks:  # (after the last step closed: its probe still replays the model's last call)
            hook.uninstall()

    def snapshot(self, *, monitor: Monitor | None = None, env: dict[str, Any] | None = None,
                 script: dict[str, Any] | None = None, notes: list[str] | None = None,
                 oom: dict[str, Any] | None = None, loader_headroom: float | None = None,
                 whole: WholeRun | None = None, final: bool = True) -> Capture:
        """The run as it stands, frozen into a `Capture` (records/capture.py): the measured steps, what the hooks
        observed, the monitor's series, what the machine says (resolve.py), and the rest of what the report shows
        (the environment, the script's outcome, notes, an out-of-memory error, a whole run's records). `final`: the
        run is over: the last step is closed, the copies' device time is read and the figures that synchronise the
        device are taken (the only device sync of the doctor's report); a mid-run snapshot leaves those out."""
        timeline, observed = self.timeline, self.observed
        if final:
            timeline.finish()
            if device_of(observed) == "cuda":
                torch.cuda.synchronize(observed.device_index)
            # the copies' own device time replaces the host time they blocked (waiting for queued kernels is compute)
            timeline.correct_transfers(self.device_timer.seconds)
        records = tuple(timeline.records)
        device = device_of(observed)
        return Capture(
            timeline=TimelineRecord(
                records=records, warmup_steps=timeline.warmup_steps, signal=timeline.signal,
                input_source=timeline.input_source, loader_fed=timeline.loader_fed,
                evaluation_steps=timeline.evaluation_steps, cycle=timeline.cycle, counts=timeline.seen(),
                samples_per_s=timeline.samples_per_s, epoch_starts=tuple(timeline.epoch_starts),
                step_marks=tuple(timeline.step_marks), left_out=tuple(timeline.left_out),
                measure_started_monotonic=timeline.measure_started_monotonic,
                measure_ended_monotonic=timeline.measure_ended_monotonic),
            observed=observed_record(observed, self.device_timer, self.collectives, device=device,
                                     measured=bool(records), final=final),
            loaders=loaders_of(self.loaders), machine=machine_record(observed, device),
            monitor=None if monitor is None else monitor.frozen(
                [observed.device_index] if device == "cuda" and observed.device_index is not None else []),
            env=env, script=script, notes=tuple(notes or ()), oom=oom, loader_headroom=loader_headroom,
            whole=None if whole is None else whole.record(), final=final, sites=self.sites())

    def sites(self) -> tuple[Site, ...]:
        """Where the script made what the fixes change (capture/sites.py): its loaders, the model, its first calls,
        its autocast block and its first checkpoint write."""
        saved = self.ledger.save_site if self.ledger is not None else None
        return (*self.loader.sites, *self.observed.sites.values(), *((saved,) if saved is not None else ()))

    def end_step(self) -> None:
        """End a step now: for callers that define steps themselves (`Timeline(explicit_steps=True)`)."""
        self.work_done()
        self.timeline.step_end()

    def work_done(self) -> None:
        if self.events is not None:
            self.events.work_done()

    def _step_closed(self, measured: bool, step: _Step) -> None:
        """The timeline closed a step: keep the compile counters and CUDA events in step with it, and give a whole
        run's ledger its span."""
        observed, timeline = self.observed, self.timeline
        ledger = self.ledger
        if ledger is not None:
            ledger.loader_fed = timeline.loader_fed
            first_input = step.first_ask if step.first_ask is not None else _earliest(step.first_forward,
                                                                                      step.first_no_grad)
            ledger.step(step.start, step.end, step.wait, step.transfer, first_input,
                        step.samples or step.forward_samples, step.opening)
        if not observed.dynamo_at_warmup and timeline.measuring:
            observed.dynamo_at_warmup = dynamo_counts()
            observed.workers_at_warmup = self.worker_clock.totals()
            observed.comm_at_warmup = self.collectives.totals(timeline.closed_steps)
        if measured and not observed.dynamo_at_end and timeline.phases[0].done:
            observed.dynamo_at_end = dynamo_counts()
            observed.workers_at_end = self.worker_clock.totals()
            observed.comm_at_end = self.collectives.totals(timeline.closed_steps)
        if self.scanning:
            self.discover("step")
        if self.events is not None:
            self.events.step_closed(measured)
        elif (ledger is None and not self.scanning and observed.dynamo_at_warmup and self.device_timer.settled
              and (observed.dynamo_at_end or timeline.max_steps is None)):  # (no step limit: __exit__ takes it)
            timeline.on_close = None  # nothing left to do per step: save the call (~0.5 us)

    def doctor_time(self, seconds: float, what: str) -> None:
        """The doctor itself just spent `seconds` on `what` (a scan, the timed candidates): not the script's."""
        self.timeline.pause(seconds)
        if self.ledger is not None:
            self.ledger.doctor(seconds, what)
