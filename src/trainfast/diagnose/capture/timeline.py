"""`Timeline`: each training step's wall time split into data wait, transfer, host overhead and compute.

What is a step. One training iteration, found from what the script does (hooks in instrument.py):
- "optimizer": when any optimizer steps. Every optimizer stepped before the next iteration starts belongs
  to the same step (a GAN's D then G step is one step; a wrapped optimizer stepping its inner one too);
  several backwards before one optimizer step are gradient accumulation, one step. The step ends when its
  last optimizer step ends; the time from there to the next batch request is the next step's host time.
- "backward": when no optimizer ever steps (manual SGD, `p.data.add_(p.grad, ...)`): each iteration's
  backward passes end it, and the parameter update and logging after them belong to it.
- "explicit": the caller ends steps itself (`diagnose(loader, step_fn)`).
Backwards inside an `optimizer.step(closure)` (LBFGS evaluates the closure up to 20 times per step) belong to that
step: they end nothing, whatever the signal.
An iteration starts with a training batch from a timed loader, or, when no loader feeds training, with the
model's first forward. The first step starts at its first input: the script's start-up before it (imports,
building the data and the model) belongs to no step. A step is closed only when the next one starts, so a
second optimizer stepped later in the same iteration can still join it.

The parts of a step:
- data wait: time blocked in a loader's `next()`; without any loader, the time from the end of one step to
  the model's first forward, a teacher's with gradients off included (input preparation in the script: slicing
  a memmap, tokenising);
- transfer: time blocked in host-to-device copies (`.to("cuda")`, `.cuda()`) the script makes. A copy timed on
  the device too (`transferred(..., copy=...)`, CUDA events) counts only up to its own device time once
  `correct_transfers` has read the events: a blocking copy first waits for the kernels queued before it, and
  that wait is compute. A copy before the step's input (a loop without a loader moving its batch) is not data
  wait either;
- host: with a loader, the gap between the end of one step and the next batch request (logging, metrics,
  checkpoints), less the time spent waiting for the device in syncs such as `.item()`;
- communication (exposed): time the script's threads were blocked in collectives across ranks (an all-reduce, an
  FSDP all-gather or reduce-scatter, DDP's wait for its gradient all-reduce at the end of backward: comms.py),
  including the wait for a slower rank to join; a collective that ran while the host computed is not in it;
- compute: the rest (forward, backward, optimizer step, device waits).
A step during which a batch was fetched with gradients off (a validation pass between two steps), or, without a
loader, the model was called three or more times with gradients off before its first training forward, is
left out and counted in `evaluation_steps`. The hooks only add floats (~1 us); nothing synchronises the device.
Which steps are measured, and how a closed step becomes a measured row, is window.py's.

Stopping. Alone, the run stops (`StopMeasuring`) at the boundary where the steps are all measured or the deadline
has passed. With a `StopAgreement` (the ranks of a torchrun job), a rank that wants to stop proposes a step a
little ahead instead, and every rank stops at the step first proposed: a rank that stopped on its own would leave
its peers in an all-reduce it never joins. Ranks in DDP lockstep are at most 2 closed steps apart (a rank cannot
finish step t+1's all-reduce before every rank has begun it), and each rank reads the agreement at least once
every `check_every` closed steps, so a step `check_every + 3` ahead of the proposer's is read by every rank before
it gets there, and before the proposer itself gets there (the store may end with the proposer's process).
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from trainfast.diagnose.capture.window import MEASURE, USUAL_OVER_STEPS, Window, _Phase, _Step


class StopMeasuring(BaseException):
    """Raised from a hook once enough steps are measured (or the time budget is spent); a BaseException so
    that a script's `except Exception:` cannot swallow it. `reason` is "steps" or "budget"."""

    def __init__(self, reason: str = "steps") -> None:
        super().__init__(reason)
        self.reason = reason


class StopAgreement(Protocol):
    """How the ranks of one job agree on the closed step at which they all stop (runner.py's, on torchrun's
    store). Both calls return the agreed (step, reason), or None: none proposed yet (`agreed`), or the agreement
    cannot be reached (the store is gone), when the rank stops alone as without one."""

    check_every: int  # closed steps between two reads of `agreed()`

    def propose(self, step: int, reason: str) -> tuple[int, str] | None:
        """Stop every rank at `step` for `reason`, unless a rank proposed a step first: that one is agreed."""
        ...

    def agreed(self) -> tuple[int, str] | None:
        ...



class Timeline(Window):
    def __init__(self, *, warmup_steps: int = 5, max_steps: int | None = None, explicit_steps: bool = False) -> None:
        if warmup_steps < 0 or (max_steps is not None and max_steps < 1):
            raise ValueError(f"warmup_steps={warmup_steps}, max_steps={max_steps}: need warmup_steps >= 0 and "
                             "max_steps >= 1 (or None for no limit)")
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.started = time.perf_counter()
        self.signal: str | None = "explicit" if explicit_steps else None  # what defines a step (module doc)
        self.batches = self.forwards = self.backwards = self.optimizer_steps = 0  # seen over the whole run
        self.training_forwards = 0  # forwards with gradients on
        self.loader_fed = False  # a timed loader delivered a training batch
        self.steps_seen = 0
        self.evaluation_steps = 0  # measured-range steps left out because they spanned an evaluation pass
        self.stop_when_done = False  # set by the zero-code runner: raise StopMeasuring when all phases are done
        self.deadline: float | None = None  # perf_counter time after which the next step boundary stops the run
        # Few attributes on purpose: with 30 on an instance (CPython shares the keys of at most 30), a fetch + step
        # measured 1.42 us instead of 1.22: every attribute read in the hooks got slower.
        self.agreement: StopAgreement | None = None  # several ranks: the stop step is agreed (module doc)
        self.closed_steps = 0  # steps closed, partial ones included: the count every rank shares
        self.stop_at: tuple[int, str] | None = None  # the agreed (closed step, reason) to stop at, once known
        self.measure_started_monotonic: float | None = None  # time.monotonic() when measuring began (monitor's clock)
        self.measure_ended_monotonic: float | None = None  # time.monotonic() at the end of the last measured step
        self._to_monotonic = time.monotonic() - self.started  # perf_counter -> monotonic: the monitor's clock
        self.on_phase_end: Callable[[str], None] | None = None
        # after each step closes: was it a measured one, and the step (its span: a whole run's ledger keeps them all)
        self.on_close: Callable[[bool, _Step], None] | None = None
        self.phases = [_Phase(MEASURE, warmup_steps, max_steps)]
        self._phase: _Phase | None = self.phases[0]  # the first phase not done
        self._cur = _Step(self.started, opening=True)
        self._pending: _Step | None = None
        # no-grad forwards before the training one, of the last steps: their median is what a step usually has
        self._no_grad_counts: collections.deque[int] = collections.deque(maxlen=USUAL_OVER_STEPS)
        self._collect_counts: collections.deque[int] = collections.deque(maxlen=USUAL_OVER_STEPS)
        self._in_optimizer = False  # inside optimizer.step(): a closure's forwards and backwards are part of it

    # ---- called by the hooks: keep them lean, they run every step
    def fetched(self, asked: float, got: float, samples: int) -> None:
        """A training batch (gradients on) came out of a timed loader."""
        self.batches += 1
        self.loader_fed = True
        self._begin_iteration(asked)
        cur = self._cur
        if cur.first_ask is None:
            cur.first_ask = asked
        cur.wait += got - asked
        cur.samples += samples

    def epoch_began(self) -> None:
        """The training batch just fetched was the first of its loader's new iterator: an epoch began in this step
        (its worker start-up and the last epoch's shutdown are in it: periodic.py)."""
        self._cur.epoch_began = True

    def mark(self, kind: str) -> None:
        """The step in progress did `kind` besides training (mark_hook.py): a checkpoint save, a print or log."""
        cur = self._cur
        if kind not in cur.marks:
            cur.marks += (kind,)

    def evaluation_fetch(self) -> None:
        """A batch fetched with gradients off: this step spans an evaluation pass."""
        self.batches += 1
        self._cur.evaluated = True

    def forward(self, now: float, samples: int, batch: Any = None) -> None:
        """A model's forward with gradients on (outside a loader's `next()`); `samples`: its input's leading dim,
        `batch`: the input tensor itself, when it has one (an input already counted in this step, as a closure
        re-evaluated by LBFGS's `step(closure)`, adds no samples). Counted once the iteration has begun: a forward
        the stop is raised from (StopMeasuring, at the step boundary) never ran."""
        if not self.loader_fed:
            self._begin_iteration(now)
        self.forwards += 1
        self.training_forwards += 1
        cur = self._cur
        if cur.first_forward is None:
            cur.first_forward = now
        if not cur.counted_forward:  # the first forward of each backward pass: micro-batches add up
            cur.counted_forward = True
            if batch is None or not any(ref() is batch for ref in cur.inputs):
                cur.forward_samples += samples
                if batch is not None:  # weakly: a micro-batch freed since cannot match a new one at its address
                    cur.inputs += (weakref.ref(batch),)

    def evaluation_forward(self, now: float, training: bool = False) -> None:
        """A model's forward with gradients off, the model in training mode (`training`) or not: counted.
        `EVALUATION_FORWARDS` or more of them before the step's input, beyond twice the median of recent steps',
        are a phase of their own: with the model in eval mode an evaluation pass (nanoGPT's estimate_loss calls
        model.eval()), left out as a loader's validation pass is; in training mode a collection phase (an RL
        rollout, a GAN's sampling), kept in the step and booked as collection. A teacher's forward in every step
        is neither: it is compute, and, without a loader, the first of them is where the step's input is first
        used."""
        self.forwards += 1
        cur = self._cur
        if self.loader_fed:
            if training and cur.first_ask is None:
                cur.collect_forwards += 1
            return
        if cur.first_forward is None:
            if training:
                cur.collect_forwards += 1
            else:
                cur.evaluation_forwards += 1
            if cur.first_no_grad is None:
                cur.first_no_grad = now

    def backward(self) -> None:
        self.backwards += 1
        self._cur.counted_forward = False
        if self._in_optimizer:  # a closure's evaluation inside optimizer.step(closure) (LBFGS): part of that step
            return
        if self.signal is None:
            self.signal = "backward"  # until an optimizer is seen to step
        if self.signal == "backward":
            self._complete(time.perf_counter())

    def optimizer_step_begins(self) -> None:
        """An optimizer's step() begins: backwards until it ends are a closure's (LBFGS evaluates it up to 20
        times per step), one step however many. (The instrumentation's hook sets `_in_optimizer` itself: a call
        less per step.)"""
        self._in_optimizer = True

    def optimizer_step(self, optimizer: object) -> None:
        self.optimizer_steps += 1
        self._in_optimizer = False
        if self.signal == "explicit":
            return
        now = time.perf_counter()
        if self.signal != "optimizer":
            if self.signal == "backward":  # what looked like steps were micro-batches: measure afresh
                for phase in self.phases:
                    phase.reset()
                self.steps_seen = self.evaluation_steps = 0
                if self._pending is not None:  # the micro-batches since the last one closed join this step
                    self._pending.absorb(self._cur)
                    self._cur, self._pending = self._pending, None
                self._cur.partial = self.backwards > 1  # it began at a micro-batch: too short to count
            self.signal = "optimizer"
        key = id(optimizer)
        pending = self._pending
        if pending is not None and key in pending.optimizers:  # the same optimizer again: a new step
            self._pending = None
            self._record(pending)
        self._cur.optimizers += (key,)
        self._complete(now)

    def transferred(self, seconds: float, copy: Any = None) -> None:
        """A host-to-device copy blocked the host `seconds`; `copy`: its device timing (CUDA events), if any."""
        cur = self._cur
        cur.transfer += seconds
        if copy is not None:
            if cur.copies is None:
                cur.copies = []
            cur.copies.append((copy, seconds))
        if cur.first_ask is None and cur.first_forward is None:  # before the step's input: not input preparation
            cur.gap_transfer += seconds

    def communicated(self, seconds: float) -> None:
        """The script's thread was blocked `seconds` in a collective (comms.py): exposed communication, taken out of
        compute, or, before the step's input, out of the gap that would otherwise be host work or data wait."""
        cur = self._cur
        cur.comm += seconds
        if cur.first_ask is None and cur.first_forward is None:
            cur.gap_comm += seconds

    def synced(self, seconds: float) -> None:
        cur = self._cur
        cur.syncs += 1
        if cur.first_ask is None and cur.first_forward is None:  # before the step's input: a wait for the device
            cur.gap_sync_wait += seconds

    def pause(self, seconds: float) -> None:
        """The doctor itself spent `seconds` (a one-off scan): not the script's time."""
        self._cur.start += seconds

    def step_end(self) -> None:
        """End the current step now (the caller defines steps: `diagnose(loader, step_fn)`)."""
        now = time.perf_counter()
        self._cur.end = now
        done, self._cur = self._cur, _Step(now)
        self._record(done)

    def finish(self) -> None:
        """The script ended: a completed step not yet closed is closed now (no StopMeasuring)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._record(pending, stop=False)

    # ---- step boundaries
    def _complete(self, now: float) -> None:
        """The iteration's work is done (an optimizer stepped, or a backward without optimizers): the step
        waits to be closed when the next iteration starts."""
        done, self._cur = self._cur, _Step(now)
        done.end = now
        if self._pending is None:
            self._pending = done
        else:
            self._pending.absorb(done)
            self._pending.end = now
        if self.deadline is not None and now > self.deadline:
            if self.agreement is None:
                self.finish()
            self.request_stop("budget")

    def _begin_iteration(self, now: float) -> None:
        if self._pending is None:
            return
        if self.signal == "backward":  # the update and logging after the backward belong to the step
            self._pending.absorb(self._cur)
            self._pending.end = now
            self._cur = _Step(now)
        pending, self._pending = self._pending, None
        self._record(pending)
        if self.deadline is not None and now > self.deadline:
            self.request_stop("budget")

    def _record(self, step: _Step, *, stop: bool = True) -> None:
        self.closed_steps += 1
        if not step.partial:
            self.steps_seen += 1
            phase = self._phase
            if phase is not None and phase.done:
                phase = self._phase = next((p for p in self.phases if not p.done), None)
            measured = self._measure(step, phase)
            self._no_grad_counts.append(step.evaluation_forwards)
            self._collect_counts.append(step.collect_forwards)
            if self.on_close is not None:
                self.on_close(measured and phase is not None and phase.name == MEASURE, step)
            if phase is not None and phase.done and not phase.ended:
                phase.ended = True
                if self.on_phase_end is not None:
                    self.on_phase_end(phase.name)
                if stop and self.stop_when_done and self.done:
                    self.request_stop("steps")
        if stop and self.agreement is not None:
            self._agree()

    def request_stop(self, reason: str) -> None:
        """Stop the run for `reason` ("steps" or "budget"): now, alone; with an agreement, at the step the ranks
        agree on (this one proposes `check_every + 3` closed steps ahead), raised at that step's boundary."""
        agreement = self.agreement
        if agreement is None:
            raise StopMeasuring(reason)
        if self.stop_at is None:
            self.stop_at = agreement.propose(self.closed_steps + agreement.check_every + 3, reason)
            if self.stop_at is None:  # no agreement to be had: stop alone, as a single process does
                raise StopMeasuring(reason)
        self.deadline = None  # proposed: the boundaries only wait for the agreed step now

    def _agree(self) -> None:
        """A step boundary under an agreement: read the agreed step every `check_every` closed steps (a store
        round trip: runner.py's STOP_CHECK_EVERY says what it costs), and stop at it."""
        agreement = self.agreement
        if self.stop_at is None and agreement is not None and self.closed_steps % agreement.check_every == 0:
            self.stop_at = agreement.agreed()
            if self.stop_at is not None:
                self.deadline = None
        if self.stop_at is not None and self.closed_steps >= self.stop_at[0]:
            raise StopMeasuring(self.stop_at[1])

    @property
    def input_source(self) -> str | None:
        """Where training batches came from: "loader" (a timed DataLoader), "script" (no loader: the gap
        before the model's first forward), None when neither was seen."""
        if self.loader_fed:
            return "loader"
        return "script" if self.training_forwards else None

    def seen(self) -> dict[str, int]:
        return {"batches": self.batches, "forwards": self.forwards, "backwards": self.backwards,
                "optimizer_steps": self.optimizer_steps}
