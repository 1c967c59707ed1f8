"""What one speed practice is to the Trainer's A/Bs: a class with four verbs on the settings the loop trains with.

`prior` is the setting the run starts in, `plan` queues an A/B (its two settings, the prior first) or settles the
choice at once with its reason, `apply` switches the loop to a setting, and `decide` makes the `Choice` from the
figures every rank agreed on. A practice that needs more at a cycle's start or end (precision's loss guard,
compile's compile step), figures of its own to agree on, or its own JSON form, overrides the hooks below, which
do nothing by default. The practices themselves are in `trainer/practice_kinds.py`, listed once in `PRACTICES`;
`Practices` (`trainer/practices.py`) runs them all on the one schedule: warm-up, then timed pairs until `decide`
says, or `MAX_PAIRS`. At the end, what the practices share: extra forwards without a trace (`untouched`), the same
batch's loss compared, the decision on an A/B's step times, a reason's figures.
"""

from __future__ import annotations

import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from trainfast.decide import FASTER, STEP_NOISE, Decision, decide, looks_between
from trainfast.precision.policy import DeviceCaps, PrecisionPolicy
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.step import LossOf

FIRST_TIMED = 2  # the cycle timed first: cycles 0 and 1 are the prior's and the alternative's warm-up
MIN_PAIRS = 2  # timed pairs (one step of each setting) before the first look: one pair has no spread of its own
# The most timed pairs an A/B takes. Simulated with adjacent steps ~5 % apart (`STEP_NOISE`, a quiet 2-core CPU), 4
# pairs tell a 1.2x gain from none in 98 % of A/Bs and a 1.15x one in 79 % (most at 2-3 pairs); a 5th pair raises
# 1.15x to 89 % for 2 more steps, and would lift the shortest run that can afford an A/B from 30 steps to 36 (the
# tests' 30-32-step runs, and `MIN_RUN_MULTIPLE` below). A gain of 1.10x or less is mostly not told in 4 pairs: the
# safe setting stays.
MAX_PAIRS = 4
MAX_STEPS = FIRST_TIMED + 2 * MAX_PAIRS  # 10: the optimizer steps an A/B takes at most (its budget)
LOOKS = looks_between(MIN_PAIRS, MAX_PAIRS)  # 3 looks (after pairs 2, 3 and 4) share the decision's confidence
# An A/B runs only in a run of at least this many times its budget: at most 1/6 of the run's steps are then taken in
# the slower setting (its warm-up and 4 timed steps: 5 of a 30-step run), which costs ~3 % of the run when that
# setting is 1.2x slower (1/6 x 0.2 = 3.3 %; decided at 2.6 pairs on average, 2.4 %). A wider gap ends the A/B
# sooner: 1.5x (the bf16/fp32 ratio of the demo ConvNet on a 2-core AVX512-BF16 CPU) is decided at 2 pairs, 3 slow
# steps of 30, 3 x 0.5 / 30 = 5 % (8.3 % when every A/B took a fixed 8 steps of a 24-step run), less in a longer run.
MIN_RUN_MULTIPLE = 3
LOSS_TOLERANCE = 0.05  # the same batch's loss in another setting (a mixed precision, compiled): relative gap allowed
Agree = Callable[[list[float]], list[float]]  # each value's max over all ranks (the values themselves when alone)


class Settings:
    """What the loop trains with, which the practices switch: the precision, the layout, the model to call."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, caps: DeviceCaps,
                 precision: PrecisionPolicy, channels_last: bool) -> None:
        self.module, self.optimizer, self.device, self.caps = model, optimizer, device, caps
        self.precision, self.channels_last = precision, channels_last
        self.model: nn.Module = model  # what the loop calls: the (DDP-wrapped) model, or its compiled form
        self.eager: nn.Module = model  # the same uncompiled
        self.agree: Agree = lambda values: values
        self.settled_step_s: float | None = None  # the last A/B's median step in the setting it settled on


@dataclass
class Choice:
    """What one practice chose and why, with the A/B's figures (JSON-ready through `to_json`)."""

    practice: str  # the practice's `name`
    chosen: str
    reason: str
    step_s: dict[str, float] = field(default_factory=dict)  # median step time per measured setting
    loss: dict[str, float] = field(default_factory=dict)  # the first batch's loss per precision (the guard)
    decision: Decision | None = None  # the A/B's decision on its agreed step times, as the practice chose by it
    steps: int = 0  # optimizer steps the A/B took (0: none ran)
    pairs: int = 0  # timed pairs among them

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chosen": self.chosen, "reason": self.reason, "measured": bool(self.step_s)}
        return out | {"step_s": self.step_s} | ({"loss": self.loss} if self.loss else {}) | self.ab_json()

    def ab_json(self) -> dict[str, Any]:
        """How long the A/B ran and what it decided: `steps`, `pairs`, `decision` (None: no decision was made)."""
        return {"steps": self.steps, "pairs": self.pairs,
                "decision": self.decision.to_json() if self.decision is not None else None}


@dataclass
class AB:
    """One A/B under way: its two settings alternate cycle by cycle over real training steps."""

    settings: tuple[str, str]  # (prior, alternative): the prior runs first
    # each timed cycle's seconds, per setting: this rank's while it runs; as every rank agreed them when decided, where
    # the i-th of each setting is pair i
    times: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)  # the alternative's timed step losses (compile's finite check)
    cycle: int = 0
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (prior's, alternative's) seconds, agreed

    def setting(self) -> str:
        """The setting this cycle trains in: the prior's warm-up, the alternative's, then timed pairs in alternating
        order (prior first, then alternative first, ...): the second of a pair runs on caches the first warmed, and a
        drift from step to step would favour the same side in every pair, where the pairs' spread cannot show it."""
        if self.cycle < FIRST_TIMED:
            return self.settings[self.cycle % 2]
        pair, second = divmod(self.cycle - FIRST_TIMED, 2)
        return self.settings[second ^ (pair % 2)]

    def agreed_times(self) -> dict[str, list[float]]:
        """`pairs` as `times`: each setting's agreed seconds, pair by pair (none: no pair was timed)."""
        if not self.pairs:
            return {}
        return {name: [pair[i] for pair in self.pairs] for i, name in enumerate(self.settings)}


@dataclass(frozen=True)
class Plan:
    """What a practice's plan is told of the run."""

    steps: int  # the fewest optimizer steps any rank plans
    fresh: bool  # a run from its first step (a resumed one takes no A/B: its start chose)
    distributed: bool
    queued: int = 0  # A/Bs queued before this practice's
    sharded: bool = False  # FSDP: its MixedPrecisionPolicy was fixed when the model was sharded

    @property
    def affordable(self) -> bool:
        """A fresh run of at least `MIN_RUN_MULTIPLE` times an A/B's budget: its worst case, whatever it decides."""
        return self.fresh and self.steps >= MIN_RUN_MULTIPLE * MAX_STEPS

    @property
    def unmeasured(self) -> str:
        """Why an A/B the run cannot afford was not run."""
        return ("resumed run, no choice saved" if not self.fresh else f"not measured: run of {self.steps} steps, "
                f"under {MIN_RUN_MULTIPLE}x the {MAX_STEPS} steps an A/B can take")


A = TypeVar("A", bound=AB)  # the record a practice keeps of its A/B: `AB` and what its hooks add


class Practice(ABC, Generic[A]):
    """One speed practice: its `name`, the setting requested for it, and the four verbs. Made once per Trainer."""

    name: ClassVar[str]  # its key in the result, its JSON and the checkpoint's saved choices

    def __init__(self, config: TrainConfig) -> None:
        self.requested = self.requested_in(config)

    @staticmethod
    @abstractmethod
    def requested_in(config: TrainConfig) -> str | bool:
        """The setting asked for: "auto" is measured; anything else is kept as asked (or as the device allows)."""

    @abstractmethod
    def prior(self, settings: Settings) -> str:
        """The setting the run starts in (for precision and layout: `prepare_step`'s, from the device's
        capabilities and the request)."""

    @abstractmethod
    def plan(self, settings: Settings, plan: Plan) -> A | Choice:
        """An A/B to queue, or the choice settled now with its reason."""

    @abstractmethod
    def apply(self, settings: Settings, setting: str) -> None:
        """Switch the loop to `setting`."""

    @abstractmethod
    def decide(self, settings: Settings, ab: A) -> Choice:
        """The choice from `ab`'s figures, as every rank agreed them."""

    # ------------------------------------------------------------------ hooks (nothing by default)
    def choice(self, chosen: str, reason: str) -> Choice:
        """A choice with no figures (a resumed run's, kept from its start) in this practice's JSON form."""
        return Choice(self.name, chosen, reason)

    def before_cycle(self, settings: Settings, ab: A, batch: Any, loss_of: LossOf) -> bool:
        """At a cycle's start, before it is switched to its setting; True when that decided the A/B already."""
        return False

    def inputs(self, ab: A, batch: Any) -> Any:
        """The micro-batch as this cycle's setting takes it."""
        return batch

    def after_cycle(self, ab: A) -> None:
        """At a cycle's end, its time taken."""

    def figures(self, ab: A) -> list[float]:
        """This rank's values the decision needs besides the step times: each is agreed (max over ranks)."""
        return []

    def agreed(self, ab: A, values: list[float]) -> A:
        """`ab` with `figures` as every rank agreed them."""
        return ab

    def settle(self, settings: Settings, choice: Choice) -> None:
        """Train with `choice` from now on."""
        self.apply(settings, choice.chosen)

    def finish(self, choice: Choice) -> None:
        """When fit ends, with what this practice chose."""


# ---------------------------------------------------------------------- what the practices share
class untouched:
    """Run extra forward passes without a trace: BatchNorm statistics, gradients and random streams put back."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device

    def __enter__(self) -> None:
        self.buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        self.grads = [(p, p.grad) for p in self.module.parameters()]
        self.rng = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        self.rng.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.rng.__exit__(None, None, None)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        for param, grad in self.grads:
            param.grad = grad


def relative_gap(loss: float | None, reference: float | None) -> float:
    """How far `loss` is from the reference loss of the same batch, relative to it (a near-zero reference counts as
    0.01); inf when `loss` is not finite, 0 when there is nothing to compare with (no finite reference)."""
    if loss is None or reference is None or not math.isfinite(reference):
        return 0.0
    if not math.isfinite(loss):
        return math.inf
    return abs(loss - reference) / max(abs(reference), 0.01)


def loss_gap(loss: float | None, reference: float | None) -> str | None:
    """How far `loss` is from the reference loss of the same batch, when beyond `LOSS_TOLERANCE` (None: within)."""
    gap = relative_gap(loss, reference)
    if gap <= LOSS_TOLERANCE or loss is None or reference is None:
        return None
    return "non-finite" if math.isinf(gap) else f"{abs(loss - reference) / max(abs(reference), 1e-12):.1%} off"


def decision(ab: AB, a: str, b: str) -> Decision:
    """Setting `b` against `a` on the A/B's agreed step times as speeds (1 / seconds), pair i of the i-th timed step
    of each, at `FASTER` and the step noise, over the `LOOKS` the A/B takes: the one rule every practice chooses by
    (either order gives the same verdict, mirrored)."""
    return decide([1 / s for s in ab.times[a]], [1 / s for s in ab.times[b]], threshold=FASTER, noise=STEP_NOISE,
                  looks=LOOKS)


def median_times(ab: AB) -> dict[str, float]:
    """Each setting's median step time (what the JSON's `step_s` reports; the decision is on the pairs)."""
    return {name: statistics.median(ts) for name, ts in ab.times.items()}


def in_ms(medians: dict[str, float]) -> str:
    """The medians as a reason quotes them: "bf16-mixed 43.4 ms vs 32-true 164.6 ms"."""
    return " vs ".join(f"{name} {s * 1e3:.1f} ms" for name, s in medians.items())
