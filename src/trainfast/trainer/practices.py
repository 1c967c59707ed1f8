"""Precision, channels_last and torch.compile chosen by measurement on the run's own first steps.

Each practice left on "auto" starts from a prior read from the device (bf16 where the chip runs it natively,
NHWC for conv nets) and is then confirmed by an A/B: two settings alternate over real training steps (both
train the model, so no step is wasted, and the cost is only what the slower setting loses), each setting's
first step is discarded as warm-up, and then the timed steps come in pairs, one of each setting. After each pair
from `MIN_PAIRS` on, `trainfast.decide` looks at the pairs; the A/B ends as soon as it is decided (faster, slower
or the same), or at `MAX_PAIRS` undecided, when the practice keeps its safe setting and says it cannot tell. Each
practice is one class in `trainer/practice_kinds.py` (its prior, plan, apply and decide, and its guards:
`Precision`'s loss check, `Compile`'s compile step), registered in `PRACTICES` there; this module runs them, knowing
none of them by name.

The length of an A/B depends on its timings, so two runs with the same seed train the same steps in the same
settings, and end bit-identical, when their A/Bs took the same steps and chose the same (each A/B's `steps` is in
fit's result); a resumed run takes no A/B and trains exactly as its start chose. Every decision is taken on values all
ranks agree on (`agree`: the element-wise max over ranks, so a step's time is the slowest rank's, which is the job's,
and a flag raised on one rank is raised on all): each pair's two times are agreed as soon as they are taken, every
rank decides on the same agreed pairs, so every rank ends each A/B at the same step, and no rank can decide alone and
leave the others inside another collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from trainfast.device import DeviceClock
from trainfast.precision.policy import DeviceCaps, PrecisionPolicy
from trainfast.trainer import practice_kinds
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.practice import (
    AB,
    FIRST_TIMED,
    LOSS_TOLERANCE,
    MAX_PAIRS,
    MAX_STEPS,
    MIN_PAIRS,
    MIN_RUN_MULTIPLE,
    Agree,
    Choice,
    Plan,
    Practice,
    Settings,
    decision,
)
from trainfast.trainer.practice_kinds import GRAPH_BREAK_LIMIT, RECOMPILE_LIMIT
from trainfast.trainer.step import LossOf

log = logging.getLogger("trainfast")
KEPT = "chosen when this run started (kept on resume)"


class Practices(Settings):
    """The settings the loop trains with (`precision`, `channels_last`, the model to call) and the A/Bs still to
    run, one per practice of `practice_kinds.PRACTICES` left to measure. The loop calls `begin` before and `end`
    after each micro-batch while `measuring` is true."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, caps: DeviceCaps,
                 precision: PrecisionPolicy, channels_last: bool, config: TrainConfig) -> None:
        super().__init__(model, optimizer, device, caps, precision, channels_last)
        # one object per class registered, made once per Trainer (compile's keeps the compiled model between fits)
        self.registered: list[Practice[Any]] = [kind(config) for kind in practice_kinds.PRACTICES]
        self.choices: dict[str, Choice] = {}
        self._queue: list[tuple[Practice[Any], AB]] = []
        self._clock = DeviceClock(device)
        self._cycle_s = 0.0
        self.on_settled: Callable[[], None] = lambda: None  # called when the last A/B has decided

    @property
    def measuring(self) -> bool:
        return bool(self._queue)

    def current(self) -> tuple[nn.Module, AbstractContextManager[object]]:
        """The model to call and the autocast to call it under, as the settings stand now."""
        return self.model, self.precision.autocast()

    def plan(self, eager: nn.Module, planned_steps: int, *, fresh: bool, distributed: bool, agree: Agree,
             saved: dict[str, str] | None = None, sharded: bool = False) -> None:
        """Decide which A/Bs this run takes (on the fewest steps any rank plans). A resumed run takes none: it trains
        with what its start chose (`saved`, from the checkpoint), since another choice would change its results."""
        self.model = self.eager = eager
        self.agree = agree
        steps = int(-agree([-float(planned_steps)])[0])  # the fewest any rank plans
        saved = saved or {}
        for practice in self.registered:
            if practice.requested == "auto" and practice.name in saved:
                self._settle(practice, practice.choice(saved[practice.name], KEPT))
                continue
            planned = practice.plan(self, Plan(steps, fresh, distributed, queued=len(self._queue), sharded=sharded))
            if isinstance(planned, Choice):
                self._settle(practice, planned)
            else:
                self._queue.append((practice, planned))
        if self._queue:
            practice, ab = self._queue[0]
            practice.apply(self, ab.setting())

    def saved(self) -> dict[str, str]:
        """The choices, for the checkpoint: a resumed run trains with them."""
        return {name: choice.chosen for name, choice in self.choices.items()}

    # ------------------------------------------------------------------ per micro-batch, while measuring
    def begin(self, batch: Any, loss_of: LossOf, *, cycle_start: bool) -> Any:
        """Before a micro-batch: switch to this cycle's setting at a cycle start; the batch as that setting takes
        it."""
        practice, ab = self._queue[0]
        if cycle_start:
            self._cycle_s = 0.0
            if practice.before_cycle(self, ab, batch, loss_of):  # decided before this cycle: the next A/B's turn
                self._finish()
                return self.begin(batch, loss_of, cycle_start=True) if self._queue else batch
            practice.apply(self, ab.setting())
        batch = practice.inputs(ab, batch)
        self._clock.start()
        return batch

    def end(self, loss: torch.Tensor, *, boundary: bool) -> None:
        """After a micro-batch: its time (the device synchronised); at the end of a timed pair, a look."""
        self._cycle_s += self._clock.elapsed()
        if not boundary:
            return
        practice, ab = self._queue[0]
        if ab.cycle >= FIRST_TIMED:  # each setting's first cycle warmed it up
            ab.times.setdefault(ab.setting(), []).append(self._cycle_s)
            if ab.setting() == ab.settings[1]:
                ab.losses.append(float(loss.detach().float()))
        practice.after_cycle(ab)
        ab.cycle += 1
        if ab.cycle > FIRST_TIMED and (ab.cycle - FIRST_TIMED) % 2 == 0:  # a pair timed: one step of each setting
            self._look(practice, ab)

    def _look(self, practice: Practice[Any], ab: AB) -> None:
        """The pair just timed, as every rank agrees it (each time the slowest rank's: a DDP step waits for every rank,
        so that is the job's step time), with the practice's own `figures` (a flag raised where any rank raised it):
        one collective per pair, on every rank alike. From `MIN_PAIRS` pairs on, the decision on the agreed pairs:
        every rank computes it from the same numbers, so every rank ends the A/B at this same step, or none does."""
        local = [ab.times[name][-1] for name in ab.settings]
        agreed = self.agree([*local, *practice.figures(ab)])
        ab.pairs.append((agreed[0], agreed[1]))
        if len(ab.pairs) >= MAX_PAIRS or (len(ab.pairs) >= MIN_PAIRS
                                          and decision(replace(ab, times=ab.agreed_times()), *ab.settings).decided):
            self._finish(agreed[2:])

    def _finish(self, figures: list[float] | None = None) -> None:
        """The A/B at the head of the queue decides, on figures every rank agrees on; the next one starts. `figures`:
        the practice's own, as agreed with the last pair (None: a guard ended the A/B at a cycle's start, and they are
        agreed now, on every rank at the same cycle, since the guard's outcome is agreed)."""
        practice, ab = self._queue.pop(0)
        if figures is None:
            own = practice.figures(ab)
            figures = self.agree(own) if own else []
        decided: AB = practice.agreed(replace(ab, times=ab.agreed_times()), figures)
        choice = replace(practice.decide(self, decided), steps=ab.cycle, pairs=len(ab.pairs))
        self._settle(practice, choice)
        log.info("%s=%s after %d A/B steps: %s", choice.practice, choice.chosen, choice.steps, choice.reason)
        if self._queue:
            practice, ab = self._queue[0]
            practice.apply(self, ab.setting())
        else:
            self.on_settled()

    def _settle(self, practice: Practice[Any], choice: Choice) -> None:
        self.choices[practice.name] = choice
        if choice.chosen in choice.step_s:
            self.settled_step_s = choice.step_s[choice.chosen]  # the step as the settings now stand
        practice.settle(self, choice)

    def finish(self) -> None:
        """When fit ends: each practice's last word on its choice (compile: frames compiled after it was chosen)."""
        for practice in self.registered:
            if practice.name in self.choices:
                practice.finish(self.choices[practice.name])

    def to_json(self) -> dict[str, Any]:
        return {name: choice.to_json() for name, choice in self.choices.items()}

    def ab_steps(self) -> dict[str, int]:
        """The optimizer steps each practice's A/B took (0: it took none), in the order the A/Bs run."""
        return {p.name: self.choices[p.name].steps for p in self.registered if p.name in self.choices}


__all__ = ["GRAPH_BREAK_LIMIT", "LOSS_TOLERANCE", "MAX_PAIRS", "MAX_STEPS", "MIN_PAIRS", "MIN_RUN_MULTIPLE",
           "RECOMPILE_LIMIT", "Choice", "Practices"]
