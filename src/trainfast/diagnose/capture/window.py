"""The measured window of a `Timeline` (timeline.py): what one step accumulates while it runs (`_Step`), the phases
whose rows are kept (`_Phase`), and how a closed step becomes a measured row, or is left out (`Window._measure`):
the warm-up, a step that spans an evaluation pass, a step outside a cyclic window. Then what the report reads: the
measured steps as records, samples/s over the window, the epoch starts, the copies' device time.

Collection phases. A step whose update is preceded by many no-grad forwards of a model in training mode (an RL
rollout: action choices between environment steps; a GAN's sampling) is kept, and the time from its start to the
update's input is booked as collection, its own share, not data wait or host. Once such a step is seen, the measured
window spans whole cycles: it starts at a collection step and ends just before the first one after its steps are
in (or at `MAX_CYCLE_STEPS` times the steps asked for). samples/s is the samples of every step in the window (those
left out of the split too) over its wall time.

Phases: the steps after the warm-up are measured in the "measure" phase; a caller may add phases (the
runner measures a few steps at another thread count) from `on_phase_end`.

Epoch starts: a measured step in which a training loader's new iterator delivered its first batch is marked
(`epoch_starts`, a flag set at that fetch, no cost per step): with workers that do not persist, it holds their
restart, and periodic.py takes what such steps cost from the step times.
"""

from __future__ import annotations

import collections
import statistics
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainfast.diagnose.records.steps import EVALUATION, StepRecord

MEASURE = "measure"


# No-grad forwards before a step's first training forward, beyond what steps usually have (a distillation
# teacher's forward every step, an RL loop's action choices), that make it span an evaluation pass.
EVALUATION_FORWARDS = 3


# Steps whose no-grad forwards make "usual" (their median): evaluation passes are rare bursts among them.
USUAL_OVER_STEPS = 100


# A cyclic window (module doc) ends at the first cycle boundary after its steps, or, for cycles longer than this many
# times the steps asked for, where it is (the report says the window ends mid-cycle).
MAX_CYCLE_STEPS = 4


@dataclass(slots=True)
class _Step:
    """What one step accumulates while it runs."""

    start: float
    wait: float = 0.0
    transfer: float = 0.0
    gap_sync_wait: float = 0.0  # syncs before the step's first input: waiting for the device, not host work
    gap_transfer: float = 0.0  # copies before the step's first input: transfer (and device wait), not input
    comm: float = 0.0  # blocked in collectives (exposed communication)
    gap_comm: float = 0.0  # collectives before the step's first input: communication, not host work or input
    copies: list[tuple[Any, float]] | None = None  # (device timing, host seconds blocked) of each timed copy
    samples: int = 0  # from loader batches
    forward_samples: int = 0  # from the model's input, once per backward pass (loops without a loader)
    inputs: tuple[weakref.ref[Any], ...] = ()  # the inputs counted: a re-evaluation adds nothing
    opening: bool = False  # the first step: it starts at its first input, not when instrumentation began
    syncs: int = 0
    first_ask: float | None = None
    first_forward: float | None = None
    first_no_grad: float | None = None  # no loader: the first forward with gradients off (a teacher) uses the input
    counted_forward: bool = False
    evaluated: bool = False
    evaluation_forwards: int = 0  # no-grad forwards before the update's input, the model in eval mode
    collect_forwards: int = 0  # no-grad forwards before the update's input, the model in training mode
    partial: bool = False  # began mid-iteration: dropped, not counted
    end: float = 0.0
    optimizers: tuple[int, ...] = ()
    epoch_began: bool = False  # a training loader's new iterator delivered its first batch in this step
    marks: tuple[str, ...] = ()  # what else it was seen to do (records/steps.py MARKS)

    def absorb(self, later: _Step) -> None:
        """A later part of the same iteration (a second optimizer's step) joins this one."""
        self.wait += later.wait
        self.transfer += later.transfer
        self.comm += later.comm
        if later.copies:
            self.copies = (self.copies or []) + later.copies
        self.samples += later.samples
        self.forward_samples += later.forward_samples
        self.inputs += later.inputs
        self.syncs += later.syncs
        self.evaluated = self.evaluated or later.evaluated
        self.evaluation_forwards += later.evaluation_forwards
        self.collect_forwards += later.collect_forwards
        self.optimizers += later.optimizers
        self.epoch_began = self.epoch_began or later.epoch_began
        self.marks += tuple(m for m in later.marks if m not in self.marks)


Row = tuple[float, float, float, float, float, int, int, float, float]  # a StepRecord's fields, in order


@dataclass
class _Phase:
    name: str
    warmup: int
    steps: int | None
    rows: list[Row] = field(default_factory=list)
    copies: dict[int, list[tuple[Any, float]]] = field(default_factory=dict)  # row index -> its device-timed copies
    epoch_starts: list[int] = field(default_factory=list)  # the rows in which a training loader's epoch began
    marks: list[tuple[int, str]] = field(default_factory=list)  # (row, what else its step did: records/steps.py)
    seen: int = 0
    left_out: list[int] = field(default_factory=list)  # each step left out for spanning an evaluation: the next row
    cyclic: bool = False  # the loop collects before some updates: the window spans whole cycles (module doc)
    closed: bool = False  # the window ended (a cyclic one, at the next collection step)
    ended: bool = False  # on_phase_end was called
    # the measured window: every step after the warm-up, those left out of the rows too (they trained as well)
    window_start: float | None = None
    window_end: float = 0.0
    window_samples: int = 0
    # all its steps are in (a field, kept by `settle`, not a property: it is read several times a step)
    done: bool = False

    def settle(self) -> None:
        self.done = self.closed or (self.steps is not None and len(self.rows) >= self.steps and not self.cyclic)

    def reset(self) -> None:
        self.rows.clear()
        self.copies.clear()
        self.epoch_starts.clear()
        self.marks.clear()
        self.left_out.clear()
        self.seen, self.window_start, self.window_end, self.window_samples = 0, None, 0.0, 0
        self.settle()


class Window:
    """The phases and their rows: the part of the timeline the report reads (`Timeline` is one)."""

    # set by Timeline.__init__ (few attributes on purpose: timeline.py says why)
    started: float
    phases: list[_Phase]
    loader_fed: bool
    evaluation_steps: int
    measure_started_monotonic: float | None
    measure_ended_monotonic: float | None
    _phase: _Phase | None
    _cur: _Step
    _pending: _Step | None
    _to_monotonic: float
    _no_grad_counts: collections.deque[int]
    _collect_counts: collections.deque[int]

    def _measure(self, step: _Step, phase: _Phase | None) -> bool:
        """Add the step to its phase's rows unless it is warm-up, spans an evaluation, or falls outside a cyclic
        window (module doc); True if added."""
        if phase is None or phase.closed:
            return False
        phase.seen += 1
        collection = step.collect_forwards >= EVALUATION_FORWARDS and self._unusual(step.collect_forwards,
                                                                                      self._collect_counts)
        if collection and phase.name == MEASURE and not phase.cyclic:
            phase.cyclic = True
            if phase.window_start is not None:  # the first cycle is found mid-window: the window starts at it
                phase.reset()
                phase.seen = phase.warmup + 1
            phase.settle()
        if phase.seen <= phase.warmup:
            return False
        if phase.cyclic:
            if phase.window_start is None and not collection:
                return False  # the window starts where a cycle does
            if phase.steps is not None and len(phase.rows) >= phase.steps and (
                    collection or len(phase.rows) >= MAX_CYCLE_STEPS * phase.steps):
                phase.closed = True  # the window ends where the next cycle starts
                phase.settle()
                return False
        first_input = step.first_ask if step.first_ask is not None else _earliest(step.first_forward,
                                                                                  step.first_no_grad)
        start = step.start
        if step.opening and first_input is not None:  # not the script's start-up (imports, building the model)
            start = max(start, first_input - step.gap_sync_wait - step.gap_transfer - step.gap_comm)
        samples = step.samples or step.forward_samples
        if phase.window_start is None:
            phase.window_start = start
            if phase.name == MEASURE:
                self.measure_started_monotonic = start + self._to_monotonic
        phase.window_end = step.end
        phase.window_samples += samples
        if step.evaluated or (step.evaluation_forwards >= EVALUATION_FORWARDS
                              and self._unusual(step.evaluation_forwards, self._no_grad_counts)):
            self.evaluation_steps += 1
            phase.left_out.append(len(phase.rows))
            return False
        gap = (max(0.0, first_input - start - step.gap_sync_wait - step.gap_transfer - step.gap_comm)
               if first_input is not None else 0.0)
        collect = 0.0
        if collection:  # the collection phase and the host work around it, up to the update's input
            training_input = step.first_ask if step.first_ask is not None else step.first_forward
            end = training_input if training_input is not None else step.end
            collect, gap = max(0.0, end - start - step.gap_sync_wait - step.gap_transfer - step.gap_comm), 0.0
        # Without a loader, the time before the model's first forward is input preparation (data wait).
        wait, host = (step.wait, gap) if step.first_ask is not None or self.loader_fed else (step.wait + gap, 0.0)
        if step.copies:
            phase.copies[len(phase.rows)] = step.copies
        if step.epoch_began:
            phase.epoch_starts.append(len(phase.rows))
        if step.marks or step.evaluation_forwards:
            marks = step.marks + ((EVALUATION,) if step.evaluation_forwards else ())
            phase.marks.extend((len(phase.rows), m) for m in marks)
        comm = min(step.comm, max(0.0, step.end - start - wait - step.transfer - host - collect))
        phase.rows.append((step.end - self.started, step.end - start, wait, step.transfer, host, samples, step.syncs,
                           collect, comm))
        phase.settle()
        if phase.name == MEASURE:
            self.measure_ended_monotonic = step.end + self._to_monotonic
        return True

    @staticmethod
    def _unusual(no_grad_forwards: int, history: collections.deque[int]) -> bool:
        """A step's no-grad forwards before its input make a phase of their own (evaluation or collection:
        module doc) when there are `EVALUATION_FORWARDS` more than twice what recent steps usually have. (Callers
        skip it below EVALUATION_FORWARDS: most steps have no median to take, which costs ~1.3 us.)"""
        usual = statistics.median_low(history) if history else 0
        return no_grad_forwards >= EVALUATION_FORWARDS + 2 * usual

    # ---- read when reporting
    def correct_transfers(self, device_seconds: Callable[[Any], float]) -> None:
        """Re-book the measured steps' device-timed copies: each counts the host time it blocked only up to its
        own device time, `device_seconds(copy)`; the rest was the device finishing the kernels queued before it
        (a blocking copy from pageable memory waits for them all), which stays in the step as compute. Once all
        copies are read (after the device has synchronised); a second call changes nothing."""
        for phase in self.phases:
            for index, copies in phase.copies.items():
                end_s, total, wait, transfer, host, samples, syncs, collect, comm = phase.rows[index]
                for copy, blocked in copies:
                    transfer -= blocked - min(blocked, device_seconds(copy))
                transfer = min(max(0.0, transfer), max(0.0, total - wait - host - collect - comm))
                phase.rows[index] = (end_s, total, wait, transfer, host, samples, syncs, collect, comm)
            phase.copies.clear()

    def add_phase(self, name: str, *, warmup: int, steps: int) -> None:
        self.phases.append(_Phase(name, warmup, steps))
        if self._phase is None or self._phase.done:
            self._phase = self.phases[-1]

    def phase_records(self, name: str) -> list[StepRecord]:
        return [StepRecord(*row) for p in self.phases if p.name == name for row in p.rows]

    @property
    def records(self) -> list[StepRecord]:
        return self.phase_records(MEASURE)

    @property
    def epoch_starts(self) -> list[int]:
        """The measured steps (indices into `records`) in which a training loader's new epoch delivered its first
        batch."""
        return list(self.phases[0].epoch_starts)

    @property
    def left_out(self) -> list[int]:
        """Where a step was left out for spanning an evaluation pass: the index in `records` of the next kept one
        (the script's step count at a record is its index plus the left-out steps at or before it)."""
        return list(self.phases[0].left_out)

    @property
    def step_marks(self) -> list[tuple[int, str]]:
        """(index into `records`, what else that step was seen to do): a checkpoint save, a print or log, an
        evaluation forward (records/steps.py MARKS)."""
        return list(self.phases[0].marks)

    @property
    def done(self) -> bool:
        return all(p.done for p in self.phases)

    @property
    def samples_per_s(self) -> float | None:
        """Samples trained over the measured window's wall time: every step after the warm-up, those left out of
        the figures (an evaluation pass) included, never samples over the mean kept step (a loop that collects or
        evaluates between updates trains at the window's rate)."""
        phase = self.phases[0]
        seconds = phase.window_end - (phase.window_start or phase.window_end)
        return phase.window_samples / seconds if phase.window_samples and seconds > 0 else None

    @property
    def cycle(self) -> str | None:
        """How the measured window met the loop's cycles: None (no collection phase), "whole" (it spans whole
        cycles) or "partial" (a cycle longer than the window allows: it ends mid-cycle)."""
        phase = self.phases[0]
        if not phase.cyclic:
            return None
        return "whole" if phase.closed and len(phase.rows) < MAX_CYCLE_STEPS * (phase.steps or 0) else "partial"

    @property
    def measuring(self) -> bool:
        """The warm-up is over and the measured steps are not all taken yet."""
        phase = self.phases[0]
        return phase.seen >= phase.warmup and not phase.done

    @property
    def evaluating_now(self) -> bool:
        """The step in progress has run evaluation forwards or fetched evaluation batches so far (a step closes at
        the next one's input, after the evaluation that the last update was followed by)."""
        return self._cur.evaluated or self._cur.evaluation_forwards > 0

    @property
    def in_measured_step(self) -> bool:
        """The step in progress will be a measured one (a step completed but not yet closed comes before it):
        what a hook that costs more than a float add (CUDA events) asks. One step early for loops that end steps
        at a backward, whose work after it joins the step before."""
        phase = self.phases[0]
        return phase.seen + (self._pending is not None) >= phase.warmup and not phase.done


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None
