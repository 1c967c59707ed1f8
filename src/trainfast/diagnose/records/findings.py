"""What the doctor concludes: the verdict and the fixes it proposes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Verdict:
    name: str
    reason: str


@dataclass(frozen=True)
class Recommendation:
    id: str
    title: str
    why: str
    fix: str
    expected_gain: float | None
    # What `trainfast doctor --verify` injects to measure the fix without editing the script (None: it can't):
    # DataLoader keyword arguments (num_workers, pin_memory, persistent_workers, prefetch_factor) and
    # "threads" (intra-op threads), "cudnn_benchmark", "tf32", "autocast" (false: the script's autocast off).
    overrides: dict[str, Any] | None = field(default=None, compare=False)
    measured_gain: float | None = None  # samples/s with the fix / without it, both re-run (--verify)
    gain_basis: str = "estimate"  # "measured", "verified" or "estimate" (module doc)
    basis_reason: str | None = None  # an estimate's: why nothing was measured
    # `doctor --whole-run`: the gain on the whole run's wall time (Amdahl on the phase's share: runfixes.py)
    run_gain: float | None = None

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "title": self.title, "why": self.why, "fix": self.fix,
                "expected_gain": None if self.expected_gain is None else round(self.expected_gain, 3),
                "measured_gain": None if self.measured_gain is None else round(self.measured_gain, 3),
                "run_gain": None if self.run_gain is None else round(self.run_gain, 3),
                "gain_basis": self.gain_basis, "gain_basis_reason": self.basis_reason,
                "overrides": self.overrides}
