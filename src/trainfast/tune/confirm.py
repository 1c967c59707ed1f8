"""The tuning's last step: the search's choice against "auto", in interleaved rounds of the same training steps.

The search ranks many configurations on short trials, so its best is the best of several noisy estimates and reads
high; a configuration that oversubscribes the cores can also look fine for a few dozen batches and then train at half
the speed. So the choice is measured once more beside `make_loader`'s "auto" plan: `ROUNDS` rounds, each running both
(in alternating order, each with a fresh loader, as a training run starts), and kept only when the median of the
per-round ratios is `faster`: at least `FASTER` (1.03x, `trainfast.decide`: the noise between runs here is ~3 %, so a
smaller gain is not told apart from none). Otherwise "auto" is what `workers="tuned"` gets, and the record says why,
with both rates.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainfast.loader.tuned import WorkerSettings
from trainfast.decide import FASTER, faster
from trainfast.tune.trial import Trial

ROUNDS = 3


@dataclass(frozen=True)
class Confirmation:
    """The A/B of the search's choice (`tuned`) against "auto"'s plan, and what was kept."""

    tuned: WorkerSettings
    auto: WorkerSettings
    tuned_rates: tuple[float, ...]  # samples/s per round
    auto_rates: tuple[float, ...]

    @property
    def ratios(self) -> list[float]:
        return [t / a if a > 0 else 0.0 for t, a in zip(self.tuned_rates, self.auto_rates, strict=True)]

    @property
    def ratio(self) -> float:
        """Median of the per-round ratios tuned / auto (each round runs both: drift between rounds cancels)."""
        return statistics.median(self.ratios)

    @property
    def keeps_tuned(self) -> bool:
        return faster(self.ratio)

    @property
    def kept(self) -> WorkerSettings:
        return self.tuned if self.keeps_tuned else self.auto

    @property
    def tuned_samples_per_s(self) -> float:
        return statistics.median(self.tuned_rates)

    @property
    def auto_samples_per_s(self) -> float:
        return statistics.median(self.auto_rates)

    def reason(self) -> str:
        ratios = self.ratios
        measured = (f"{self.tuned.label()} trained at {self.tuned_samples_per_s:,.0f} samples/s, auto's "
                    f"{self.auto.label()} at {self.auto_samples_per_s:,.0f}: {self.ratio:.2f}x (median of "
                    f"{len(ratios)} interleaved rounds, {min(ratios):.2f}-{max(ratios):.2f})")
        if self.keeps_tuned:
            return f"{measured}; kept"
        return f"{measured}, not {FASTER:.2f}x or more: auto's plan kept"

    def to_json(self) -> dict[str, Any]:
        return {"tuned": self.tuned.to_json(), "auto": self.auto.to_json(), "tuned_rates": list(self.tuned_rates),
                "auto_rates": list(self.auto_rates), "tuned_samples_per_s": self.tuned_samples_per_s,
                "auto_samples_per_s": self.auto_samples_per_s, "ratio": self.ratio,
                "kept": "tuned" if self.keeps_tuned else "auto", "reason": self.reason()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Confirmation:
        return cls(WorkerSettings.from_json(data["tuned"]), WorkerSettings.from_json(data["auto"]),
                   tuple(float(r) for r in data["tuned_rates"]), tuple(float(r) for r in data["auto_rates"]))


def confirm(run: Callable[[WorkerSettings], Trial], tuned: WorkerSettings, auto: WorkerSettings,
            rounds: int = ROUNDS) -> Confirmation:
    """`run` each configuration once per round, alternating which goes first (the second of a pair inherits a
    warmer page cache and a hotter core)."""
    if tuned == auto:
        raise ValueError("nothing to confirm: the choice is auto's own plan")
    rates: dict[WorkerSettings, list[float]] = {tuned: [], auto: []}
    for r in range(rounds):
        for config in (tuned, auto) if r % 2 == 0 else (auto, tuned):
            rates[config].append(run(config).samples_per_s)
    return Confirmation(tuned, auto, tuple(rates[tuned]), tuple(rates[auto]))
