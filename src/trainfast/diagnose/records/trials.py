"""The candidate fixes timed on the script's own model (capture/probe.py): each one's trial against the base, or why it
was not measured."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from trainfast.decide import Decision, decide_rounds

TrialValue = str | int | bool | tuple[str, str] | None


@dataclass(frozen=True)
class Trial:
    """One candidate against the base, or why it was not measured (`factor` None)."""

    id: str  # the recommendation it measures: "amp", "channels_last", "threads"
    setting: str  # what was tried, in words: "bfloat16 autocast", "1 intra-op thread(s)"
    factor: float | None = None  # base time / candidate time, median of the rounds (> 1: the candidate is faster)
    low: float | None = None  # the slowest and fastest round's factor
    high: float | None = None
    rounds: int = 0
    faster_rounds: int = 0
    base_s: float | None = None  # median replay time as the script ran
    reason: str | None = None  # why not measured
    value: TrialValue = None  # the setting itself: a dtype's name, a thread count, (device, dtype) for evaluation
    applies: bool = True  # False: the fix cannot apply to this run (autocast on float64): it is not offered
    failed: bool = False  # the doctor's own preparation or replay of it failed (`reason` says which and how)
    replays: float = 1.0  # forward + backward passes of the models per training step (gradient accumulation: 2+)
    looks: int = 1  # how often the rounds were looked at to stop once decided (trainfast.decide)

    @classmethod
    def of_rounds(cls, id: str, setting: str, ratios: list[float], bases: list[float], value: TrialValue, *,
                  looks: int = 1) -> Trial:
        """A candidate measured: `ratios` the rounds' base / candidate times, `bases` the base's times."""
        return cls(id, setting, factor=statistics.median(ratios), low=min(ratios), high=max(ratios),
                   rounds=len(ratios), faster_rounds=sum(r > 1 for r in ratios), base_s=statistics.median(bases),
                   value=value, looks=looks)

    @property
    def measured(self) -> bool:
        return self.factor is not None

    @property
    def decision(self) -> Decision | None:
        """The candidate against the base by the one decision, from the rounds' median, smallest and largest ratio
        (each round a pair of adjacent replays or steps: `decide_rounds`); None when not measured."""
        if self.factor is None or self.low is None or self.high is None or self.rounds < 1 or self.low <= 0:
            return None
        return decide_rounds(self.factor, self.low, self.high, self.rounds, looks=self.looks)

    @property
    def faster(self) -> bool:
        decision = self.decision
        return decision is not None and decision.faster

    def gain(self, compute_share: float, compute_s: float) -> float | None:
        """The whole step's gain (Amdahl) when the replayed part of its compute runs `factor` times faster: the
        step's `replays` passes cover `replays * base_s` of its `compute_s` of compute, which is `compute_share` of
        the step."""
        if self.factor is None or self.base_s is None or compute_s <= 0:
            return None
        part = compute_share * min(1.0, self.replays * self.base_s / compute_s)
        return 1.0 / (1.0 - part + part / self.factor)

    def spread(self) -> str:
        return f"{self.low:.2f}-{self.high:.2f}x over {self.rounds} rounds" if self.low is not None else ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "setting": self.setting, "factor": self.factor, "low": self.low, "high": self.high,
                "rounds": self.rounds, "faster_rounds": self.faster_rounds, "base_s": self.base_s,
                "reason": self.reason, "applies": self.applies, "failed": self.failed, "replays": self.replays,
                "decision": self.decision.to_json() if self.decision else None}


@dataclass
class Trials:
    """What the probe measured, and what it could not."""

    trials: dict[str, Trial] = field(default_factory=dict)
    model: str | None = None  # the model replayed (its class)
    seconds: float = 0.0  # the probe's own time
    reason: str | None = None  # why no replay at all
    in_place: bool = False  # the models could not be copied and were replayed in place (module doc)

    def get(self, key: str) -> Trial | None:
        """The trial of "amp", "fp32", "channels_last", "contiguous" or "threads:N"."""
        return self.trials.get(key)

    def thread_probe(self) -> tuple[int, float] | None:
        """(threads, slowdown) of the fewest-threads count measured, for the loader fix that proposes it."""
        measured = [(t.value, t.factor) for key, t in self.trials.items()
                    if key.startswith("threads:") and isinstance(t.value, int) and t.factor]
        fewest = min(measured, default=None)
        return (fewest[0], 1 / fewest[1]) if fewest is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "seconds": self.seconds, "reason": self.reason, "in_place": self.in_place,
                "covers": "one forward and backward of each model on its first training input (the gradient of the "
                          "outputs' mean stands in for the loss; the optimizer step is not in it)",
                "trials": [t.to_json() for t in self.trials.values()]}


@dataclass(frozen=True)
class TrialRequest:
    """A candidate a fix wants timed on the script's model (fixes/rule.py `Rule.trials`): "amp" (`value`: the
    autocast dtype's name), "fp32" (the script's autocast off), "channels_last", "contiguous" (the script's
    channels_last off), "threads" (`value`: the intra-op thread count). With `skip`, it cannot apply to this run:
    recorded as such (`Trial.applies` False), not timed."""

    id: str
    setting: str  # in words: "bfloat16 autocast", "1 intra-op thread(s)"
    value: TrialValue
    skip: str | None = None

    @property
    def key(self) -> str:
        return f"threads:{self.value}" if self.id == "threads" else self.id
