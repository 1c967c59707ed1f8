"""`TuneResult`, cached by `trainfast.loader.tuned`: one JSON file per (dataset, batch size, step, hardware) under
$TRAINFAST_CACHE/tune, where `make_loader(..., workers="tuned")` finds its `chosen` configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfast.loader import tuned
from trainfast.loader.tuned import FORMAT, WorkerSettings
from trainfast.tune.confirm import Confirmation
from trainfast.tune.trial import Trial


@dataclass
class TuneResult:
    chosen: WorkerSettings
    chosen_samples_per_s: float
    baseline: WorkerSettings
    baseline_samples_per_s: float
    trials: list[Trial]
    sweep_seconds: float
    key: str
    describes: dict[str, Any] = field(default_factory=dict)  # what the key was made from, for people
    auto: WorkerSettings | None = None  # make_loader's "auto" plan, where the search started
    confirmation: Confirmation | None = None  # the search's choice against auto; None when it was auto's plan
    search_seconds: float | None = None  # the search alone; sweep_seconds includes the confirmation

    @property
    def kept_reason(self) -> str:
        """Why `chosen` is what `workers="tuned"` gets."""
        if self.confirmation is not None:
            return self.confirmation.reason()
        if self.auto is not None and self.chosen == self.auto:
            return "the search's choice is auto's own plan"
        return "not confirmed against auto"

    @property
    def speedup(self) -> float:
        return self.chosen_samples_per_s / self.baseline_samples_per_s if self.baseline_samples_per_s else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_json(), "chosen_samples_per_s": self.chosen_samples_per_s,
                "baseline": self.baseline.to_json(), "baseline_samples_per_s": self.baseline_samples_per_s,
                "speedup": self.speedup, "trials": [t.to_json() for t in self.trials],
                "sweep_seconds": self.sweep_seconds, "search_seconds": self.search_seconds, "key": self.key,
                "describes": self.describes, "auto": self.auto.to_json() if self.auto else None,
                "confirmation": self.confirmation.to_json() if self.confirmation else None,
                "kept_reason": self.kept_reason, "format": FORMAT}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TuneResult:
        trials = [Trial(WorkerSettings.from_json(t["config"]), t["samples_per_s"], t["seconds"], t.get("batches", 0))
                  for t in data["trials"]]
        auto, confirmation = data.get("auto"), data.get("confirmation")
        return cls(WorkerSettings.from_json(data["chosen"]), data["chosen_samples_per_s"],
                   WorkerSettings.from_json(data["baseline"]), data["baseline_samples_per_s"], trials,
                   data["sweep_seconds"], data["key"], data.get("describes", {}),
                   WorkerSettings.from_json(auto) if auto else None,
                   Confirmation.from_json(confirmation) if confirmation else None, data.get("search_seconds"))


def save(result: TuneResult) -> Path:
    return tuned.save(result.key, result.to_json())


def load(dataset: Any, batch_size: int, *, device: str) -> TuneResult | None:
    """The cached result for this dataset and batch size on this machine: with a training step if there is
    one, else of the loader alone; None when it was never tuned (or the cache is unreadable)."""
    return tuned.read(dataset, batch_size, device=device, parse=TuneResult.from_json)
