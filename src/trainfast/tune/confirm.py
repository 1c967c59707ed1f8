"""The tuning's last step: the search's choice against "auto", in interleaved rounds of the same training steps.

The search ranks many configurations on short trials, so its best is the best of several noisy estimates and reads
high; a configuration that oversubscribes the cores can also look fine for a few dozen batches and then train at half
the speed. So the choice is measured once more beside `make_loader`'s "auto" plan, in rounds
that each run both (in alternating order, each with a fresh loader, as a training run starts): `FIRST` rounds, then
one more at a time up to `ROUNDS`, until the one decision (`trainfast.decide`: each round a pair, at the noise of
measurements inside one process) can tell. The choice is kept only when decided faster: at least `FASTER` (1.03x)
with its interval clear of no gain. Otherwise (slower, the same, or cannot tell within `ROUNDS`) "auto" is what
`workers="tuned"` gets, and the record says why, with both rates and the interval.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainfast.decide import STEP_NOISE, Decision, decide, looks_between, sequential
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune.trial import Trial

# 2 rounds first, up to 5: a 1.3x choice is decided in 2-3 rounds at ~5 % noise; the tuner's budget share is sized
# for 5 (tuner.py CONFIRM_SHARE)
FIRST, ROUNDS = 2, 5


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
    def decision(self) -> Decision:
        """tuned against auto, each round a pair (each round runs both: drift between rounds cancels)."""
        return decide(list(self.auto_rates), list(self.tuned_rates), noise=STEP_NOISE,
                      looks=looks_between(FIRST, ROUNDS))

    @property
    def ratio(self) -> float:
        """The decision's estimate of tuned / auto: the median of the per-round ratios."""
        return self.decision.ratio

    @property
    def keeps_tuned(self) -> bool:
        return self.decision.faster

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
        d = self.decision
        measured = (f"{self.tuned.label()} trained at {self.tuned_samples_per_s:,.0f} samples/s, auto's "
                    f"{self.auto.label()} at {self.auto_samples_per_s:,.0f}: {d.interval()} of interleaved rounds")
        if self.keeps_tuned:
            return f"{measured}; faster: kept"
        why = {"slower": "slower", "same": f"within {d.threshold:g}x",
               "inconclusive": f"cannot tell at {d.threshold:g}x"}[d.verdict]
        return f"{measured}; {why}: auto's plan kept"

    def to_json(self) -> dict[str, Any]:
        return {"tuned": self.tuned.to_json(), "auto": self.auto.to_json(), "tuned_rates": list(self.tuned_rates),
                "auto_rates": list(self.auto_rates), "tuned_samples_per_s": self.tuned_samples_per_s,
                "auto_samples_per_s": self.auto_samples_per_s, "ratio": self.ratio,
                "kept": "tuned" if self.keeps_tuned else "auto", "reason": self.reason(),
                "decision": self.decision.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Confirmation:
        return cls(WorkerSettings.from_json(data["tuned"]), WorkerSettings.from_json(data["auto"]),
                   tuple(float(r) for r in data["tuned_rates"]), tuple(float(r) for r in data["auto_rates"]))


def confirm(run: Callable[[WorkerSettings], Trial], tuned: WorkerSettings, auto: WorkerSettings) -> Confirmation:
    """`run` each configuration once per round, alternating which goes first (the second of a pair inherits a
    warmer page cache and a hotter core), until the decision is made (module doc)."""
    if tuned == auto:
        raise ValueError("nothing to confirm: the choice is auto's own plan")

    def round_(r: int) -> tuple[float, float]:
        rates = {config: run(config).samples_per_s for config in ((tuned, auto) if r % 2 == 0 else (auto, tuned))}
        return max(rates[auto], 1e-9), max(rates[tuned], 1e-9)  # a trial that trained nothing is at ~0
    _, pairs = sequential(round_, first=FIRST, budget=ROUNDS, noise=STEP_NOISE)
    return Confirmation(tuned, auto, tuple(p[1] for p in pairs), tuple(p[0] for p in pairs))
