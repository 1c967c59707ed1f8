"""What one speed practice is to the Trainer's A/Bs: a class with four verbs on the settings the loop trains with.

`prior` is the setting the run starts in, `plan` queues an A/B (its two settings, the prior first) or settles the
choice at once with its reason, `apply` switches the loop to a setting, and `decide` makes the `Choice` from the
figures every rank agreed on. A practice that needs more at a cycle's start or end (precision's loss guard,
compile's compile step), figures of its own to agree on, or its own JSON form, overrides the hooks below, which
do nothing by default. The practices themselves are in `trainer/practice_kinds.py`, listed once in `PRACTICES`;
`Practices` (`trainer/practices.py`) runs them all on the one fixed schedule. At the end, what the practices share:
extra forwards without a trace (`untouched`), the same batch's loss compared, a reason's figures.
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

from trainfast.precision.policy import DeviceCaps, PrecisionPolicy
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.step import LossOf

TIMED = 3  # timed steps per setting, after its warm-up step: the median of 3 shrugs off one outlier
CYCLES = 2 * (1 + TIMED)  # optimizer steps one A/B takes, always (a timing-dependent end would make runs differ)
FIRST_TIMED = 2  # the cycle timed first: cycles 0 and 1 are the prior's and the alternative's warm-up
# An A/B runs only in a run of at least this many times its steps: at most 1/6 of the run's steps are then taken
# in the slower setting, which costs ~3 % of the run when that setting is 1.2x slower (the bf16/fp32 ratio of the
# demo ConvNet on a 2-core AVX512-BF16 CPU is 1.5x).
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

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chosen": self.chosen, "reason": self.reason, "measured": bool(self.step_s)}
        return out | {"step_s": self.step_s} | ({"loss": self.loss} if self.loss else {})


@dataclass
class AB:
    """One A/B under way: its two settings alternate cycle by cycle over real training steps."""

    settings: tuple[str, str]  # (prior, alternative): the prior runs first
    times: dict[str, list[float]] = field(default_factory=dict)  # each timed cycle's seconds, per setting
    losses: list[float] = field(default_factory=list)  # the alternative's timed step losses (compile's finite check)
    cycle: int = 0

    def setting(self) -> str:
        """The setting this cycle trains in: the prior's and the alternative's cycles alternate."""
        return self.settings[self.cycle % 2]


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
        return self.fresh and self.steps >= MIN_RUN_MULTIPLE * CYCLES

    @property
    def unmeasured(self) -> str:
        """Why an A/B the run cannot afford was not run."""
        return ("resumed run, no choice saved" if not self.fresh else f"not measured: run of {self.steps} steps, "
                f"under {MIN_RUN_MULTIPLE}x the {CYCLES} steps an A/B takes")


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


def median_times(ab: AB) -> dict[str, float]:
    """Each setting's median step time: the median of `TIMED` shrugs off one outlier."""
    return {name: statistics.median(ts) for name, ts in ab.times.items()}


def median_of(ab: AB) -> str:
    """How many timed steps each median is of, for a reason's figures."""
    return f", median of {min(len(ts) for ts in ab.times.values()) if ab.times else 0}"


def in_ms(medians: dict[str, float]) -> str:
    """The medians as a reason quotes them: "bf16-mixed 43.4 ms vs 32-true 164.6 ms"."""
    return " vs ".join(f"{name} {s * 1e3:.1f} ms" for name, s in medians.items())
