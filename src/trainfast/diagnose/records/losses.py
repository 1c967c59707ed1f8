"""The script's own loss over a run's steps (`LossTrace`: capture/losses.py keeps each backward's scalar), and the one
rule that says whether a run with a fix trains the same as the baseline runs (`trains_same`). "Is it faster" is
decide.py's; this is a different question, asked of the same runs by `--verify` (report/verify.py): a fix that makes
the loop faster but changes what it learns (loader workers that never see the dataset the loop changes) is not a
speed fix.

What is compared. Each run's losses are the mean of its backwards' scalars per step, keyed by the script's step index
(0 = its first step), so runs that warm up for different lengths (more loader workers warm up longer:
report/verify.py `steady_warmup`) are compared at the same steps: the second half of the baselines' measured steps
(`tail`; a whole run: the second half of its last steps). A run's figure there is the mean (`over`).

The rule. A fix departs when |fix - mean(baselines)| exceeds the larger of `SPREADS` times the baselines' own spread
and `FLOOR` of the baselines' loss. Their spread is the larger of the range between the baselines (the run-to-run
difference: another initialisation, another shuffle) and each baseline's step-to-step spread over those steps (its sd:
with only two baselines, their range alone is one draw of a difference, ~0 now and then, and a fix would be told
apart from two baselines that happened to agree).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# SPREADS, measured (benchmarks/verify_trains_same.py --verifies 10, BENCHMARKS.md): on two unseeded scripts whose
# dataset the loop never touches (curriculum.py --fixed, the seeds' before_loop.py), 10 --verify runs each, 0 of 20
# fixes were called "trains differently", and over every (fix, two baselines) triple of their 30 runs' losses (12,180
# a script) |run - mean(two others)| / their spread was at most 0.95 and 0.76 (99th percentile 0.69 and 0.49): 3
# leaves 3x room beyond the worst seen. The step-to-step sd is in the spread for that: with the two baselines' range
# alone the same ratio reached 777 and 447 (two runs that happen to agree); with the sd over the steps' count (the
# tail mean's standard error) instead of the sd, 0.8 % of triples passed 3. A curriculum the workers never see
# (tests/integration/scripts/curriculum.py) departs by 20-60 times the limit. What the sd costs: a loss must move by
# 3 of its step-to-step sds to count (~30 % of a small-batch classifier's loss here: a gross change of what is
# learned, as the workers' stale dataset is, not a subtle one).
# FLOOR: where the steps' losses hardly vary (a full batch, a converged loss) the spread is ~0, and float rounding
# alone must not count: bf16 autocast against fp32 moved a seeded full-batch MLP's mean loss over 30 steps by 0.05 %
# here, a thread count by nothing; 5 % is 100 times that.
SPREADS = 3.0
FLOOR = 0.05


@dataclass(frozen=True)
class LossTrace:
    """A run's loss per step: `values[i]` is the mean loss of step `first + i`'s backwards (None: none seen in it),
    `steps` the (first, last) step index the comparison reads from (the measured window; a whole run: its last
    steps kept), `unseen` why no loss was seen at all (a backward on a non-scalar, only a closure's), else None."""

    first: int | None
    values: tuple[float | None, ...]
    steps: tuple[int, int] | None
    unseen: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"first": self.first, "values": list(self.values), "steps": list(self.steps) if self.steps else None,
                "unseen": self.unseen}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> LossTrace:
        if not data:
            return cls(None, (), None, "the run wrote no loss record")
        steps = data.get("steps")
        return cls(data.get("first"), tuple(data.get("values") or ()),
                   (int(steps[0]), int(steps[1])) if steps else None, data.get("unseen"))

    def over(self, steps: tuple[int, int]) -> tuple[float, float, int] | None:
        """The mean loss over steps `steps[0]..steps[1]` (inclusive), its step-to-step sd and how many steps had one;
        None where none did."""
        if self.first is None:
            return None
        seen = [v for i, v in enumerate(self.values, self.first) if steps[0] <= i <= steps[1] and v is not None
                and math.isfinite(v)]
        if not seen:
            return None
        return statistics.fmean(seen), statistics.stdev(seen) if len(seen) > 1 else 0.0, len(seen)

    @property
    def tail_steps(self) -> tuple[int, int] | None:
        return tail(self.steps) if self.steps else None


def tail(steps: tuple[int, int]) -> tuple[int, int]:
    """The second half of steps `first..last`: past the fastest fall of a loss that starts high."""
    first, last = steps
    return first + (last - first + 1) // 2, last


@dataclass(frozen=True)
class LossCheck:
    """A fix's loss against the baselines' over the same steps: `same` True / False (departs), None where a loss is
    missing (`reason` says which and why)."""

    same: bool | None
    fix: float | None = None
    baseline: float | None = None
    spread: float | None = None  # the baselines' own (module doc)
    limit: float | None = None  # how far the fix may be from `baseline`
    steps: tuple[int, int] | None = None
    reason: str | None = None  # why there is no answer ("loss not seen: ..."), or how it departs

    def to_json(self) -> dict[str, Any]:
        return {"same": self.same, "fix": self.fix, "baseline": self.baseline, "spread": self.spread,
                "limit": self.limit, "steps": list(self.steps) if self.steps else None, "reason": self.reason}

    def said(self) -> str:
        """"loss 2.635 with it against the baselines' 1.635 over steps 6-9: beyond the 0.18 their spread allows
        (3 x 0.06, or 5 % of their loss)"."""
        if self.same is None or self.fix is None or self.baseline is None:
            return self.reason or "loss not seen"
        where = f" over steps {self.steps[0]}-{self.steps[1]}" if self.steps else ""
        return (f"loss {self.fix:.4g} with it against the baselines' {self.baseline:.4g}{where}: "
                f"{'within' if self.same else 'beyond'} the {self.limit:.2g} their spread allows ({SPREADS:g} x "
                f"{self.spread:.2g}, or {FLOOR:.0%} of their loss)")


def trains_same(fix: float, baselines: Sequence[float], step_sds: Sequence[float], *,
                steps: tuple[int, int] | None = None) -> LossCheck:
    """The rule (module doc): `fix` the fix's mean loss over the compared steps, `baselines` each baseline run's over
    the same steps, `step_sds` each baseline's step-to-step sd there. ValueError without a baseline."""
    if not baselines:
        raise ValueError("no baseline loss: give the loss of at least one baseline run over the same steps")
    centre = statistics.fmean(baselines)
    spread = max([max(baselines) - min(baselines), *step_sds])
    limit = max(SPREADS * spread, FLOOR * abs(centre))
    same = abs(fix - centre) <= limit
    check = LossCheck(same, fix, centre, spread, limit, steps)
    return check if same else LossCheck(False, fix, centre, spread, limit, steps, check.said())
