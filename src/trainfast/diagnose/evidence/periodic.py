"""Steps slow at a period: each epoch's first step, or every N-th step, and what they cost.

Each epoch's first. The timeline marks the measured step in which a training loader's new iterator delivered its
first batch (`Timeline.epoch_starts`). With worker processes that do not persist, that step holds the last epoch's
shutdown (joining its workers), the new epoch's fork of the workers and their wait for the first batch; and the
steps right after it may be slow too: the new workers make their whole prefetch queue at once (num_workers x
prefetch_factor batches), competing for the cores with the step. A loop that re-iterates its loader every 8 steps
(a `cycle(loader)` generator) pays it every 8th step: on the stand-in below, a 35 ms step took ~120 ms at each epoch
start and ~45 ms the three after it, where iter() to the first batch alone took 35-45 ms.

What happens at the period. The timeline marks each measured step that made a checkpoint save, a print or log, or
an evaluation forward (`TimelineRecord.step_marks`): a mark on (nearly) every slow run and on few other steps
(`NAMED_ON`, `NAMED_ELSEWHERE`) names the period ("each with a checkpoint save"); an epoch start is named only where
one was marked. A period with no such mark is named as unseen, never guessed: the HF Trainer's evaluation and save
every 8 steps once read as "each epoch's first" when no epoch began.

Every N-th step. Without epoch starts that stand out, steps at least `SLOW` times the typical one are periodic when
they fall on a lattice of equal gaps (`_every_nth`: `MIN_RUNS` points or more, most of them slow, holding most of
the slow runs' first steps): logging, a checkpoint or an evaluation every N steps.

What they cost. The slow run of each period starts at a marked (or found) step and goes on while the median over
the periods of the step k places further on stands above the other steps' 90th percentile. Its excess is the run's
time less as many steps at the other steps' mean: a period without it would take `period` steps at that mean (the
throughput is over the mean step; with the cost gone, those steps take what the others take on average). So
epoch time = period x mean other step + excess, and the throughput gain of removing the cost is
epoch time / (epoch time - excess). The other steps are those outside every slow run; the window may hold a share
of periodic steps other than 1 / period, so its own mean step is not used.

What persistent workers save (`epoch_cost`) is the epoch-start step's excess alone, over the mean of all the other
steps, those after it included. Measured on tests/integration/scripts/cycle_loader.py (8 steps an epoch, 2 workers,
2-core EPYC, medians over 20 epochs, ms by place in the epoch): restarted 123 45 45 44 34 34 34 34, persistent
65 40 40 40 31 32 31 32. Workers that persist still make the new epoch's first batch after iter() and fill their
queues beside the next steps, so the steps after the start stay slow; and the restarted loop's other steps were
~3 ms slower too, a cost of the restart spread over the epoch that the start's excess over them leaves out. The
epoch-start step alone gave 1.27x, the run of 4 slow steps 1.43x, against 1.27-1.31x measured (mean step 51.1-51.9
ms restarted, 39.1-39.7 ms persistent).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from trainfast.diagnose.records.steps import MARKS, StepRecord
from trainfast.monitor import percentile

# A step at least this many times the typical (median) one is slow, for a period found without epoch starts.
SLOW = 1.5


# Epoch-start steps stand out when their median is at least this many times the other steps' median (and above the
# other steps' 90th percentile): below it, what an epoch start costs is within what any step varies.
EPOCH_SLOW = 1.2


# Occurrences needed: 2 epoch starts (each is marked, not guessed); 4 points of a period found from the step times
# alone (with 3, a quarter of the steps slow at random made a period in ~1.4 % of 30-step runs; with 4, ~0.9 %).
MIN_EPOCH_STARTS = 2


MIN_RUNS = 4


# A period found from the step times alone: this share of its steps are slow, and of the slow runs begin on it.
ON_LATTICE = 0.75


# Steps measured, at the least, before a period is looked for.
MIN_STEPS = 6


# A mark names a period when this share of its slow runs have it, and at most `NAMED_ELSEWHERE` of the other steps.
NAMED_ON = 0.75


NAMED_ELSEWHERE = 0.25


@dataclass(frozen=True)
class Periodic:
    """Steps slow at a period in the measured window."""

    period: int  # steps from one slow run's start to the next
    starts: tuple[int, ...]  # the measured steps (indices into the records) where each slow run begins
    span: int  # slow steps in each run: 1, that step alone; 2, the step after it too
    epoch_starts: bool  # the runs begin where a training loader's new epoch delivered its first batch
    slow_s: float  # median time of the runs' first steps
    typical_s: float  # median of the other steps
    other_mean_s: float  # mean of the other steps
    other_p10_s: float
    other_p90_s: float
    excess_s: float  # mean time a run took beyond as many other steps (at their mean)
    stands_out: bool = True  # the runs' first steps stand out from the others (`epoch_cost` gives it either way)
    seen: tuple[str, ...] = ()  # what the slow runs were seen to do, the others not (module doc; steps.py MARKS)
    script_period: int | None = None  # the period in the script's steps, where steps spanning an evaluation
    # were left out of the records between the runs (every 8th of the script's steps is every 7th record)

    @property
    def epoch_s(self) -> float:
        """A period's time: `period` steps at the other steps' mean, plus the excess."""
        return self.period * self.other_mean_s + self.excess_s

    @property
    def gain(self) -> float | None:
        """Throughput with the periodic cost gone over throughput with it."""
        rest = self.epoch_s - self.excess_s
        return self.epoch_s / rest if rest > 0 else None

    def phrase(self) -> str:
        """"every 8th step (each epoch's first) takes 1.9 s against 0.8 s", and the step after when it is slow too."""
        saw = f"with {' and '.join(self.seen)}" if self.seen else ""
        which = (f" (each epoch's first{', ' + saw if saw else ''})" if self.epoch_starts
                 else f" (each {saw})" if saw else "")
        unit = self.slow_s >= 1  # seconds for all three, or milliseconds
        after = ("" if self.span == 1 else f", and the step after it {_seconds(self._after_s(), unit)}"
                 if self.span == 2 else
                 f", and the {self.span - 1} steps after it {_seconds(self._after_s(), unit)} on average")
        return (f"every {_ordinal(self.script_period or self.period)} step{which} takes "
                f"{_seconds(self.slow_s, unit)} against {_seconds(self.typical_s, unit)}{after}")

    def _after_s(self) -> float:
        # the run's steps after its first, on average: from the excess, which is over the other steps' mean
        run = self.excess_s + self.span * self.other_mean_s
        return max(0.0, (run - self.slow_s) / (self.span - 1))

    def to_json(self) -> dict[str, Any]:
        return {"period": self.script_period or self.period, "steps": list(self.starts), "span": self.span,
                "epoch_starts": self.epoch_starts, "seen": list(self.seen), "slow_s": self.slow_s,
                "typical_s": self.typical_s, "other_mean_s": self.other_mean_s, "excess_s": self.excess_s,
                "epoch_s": self.epoch_s}


def periodic_steps(records: Sequence[StepRecord], epoch_starts: Sequence[int] = (),
                   marks: Sequence[tuple[int, str]] = (), left_out: Sequence[int] = ()) -> Periodic | None:
    """The steps slow at a period among the measured `records`: at the marked `epoch_starts` (indices into the
    records) when those stand out, else every N-th step when the slow ones fall at equal gaps; None when neither.
    `marks`: (index, what that step did besides training), which name the period (module doc); `left_out`: the
    records before which a step spanning an evaluation was left out, which the script counted as steps."""
    totals = [r.total_s for r in records]
    if len(totals) < MIN_STEPS:
        return None
    starts = sorted({i for i in epoch_starts if 0 <= i < len(totals)})
    found = _at(totals, starts, _period(starts), epoch=True) if len(starts) >= MIN_EPOCH_STARTS else None
    found = found if found is not None else _every_nth(totals)
    if found is None:
        return None
    if marks:
        found = replace(found, seen=_seen(found, len(totals), marks))
    if left_out:
        skipped = sorted(left_out)
        found = replace(found, script_period=_period([i + bisect.bisect_right(skipped, i) for i in found.starts]))
    return found


def _seen(found: Periodic, steps: int, marks: Sequence[tuple[int, str]]) -> tuple[str, ...]:
    """The marks on `NAMED_ON` of the slow runs (any of their steps) and on at most `NAMED_ELSEWHERE` of the
    other steps, in `MARKS` order."""
    inside = {i + k for i in found.starts for k in range(found.span)}
    others = steps - len(inside & set(range(steps)))
    seen = []
    for kind in MARKS:
        marked = {i for i, m in marks if m == kind}
        runs = sum(1 for i in found.starts if marked & set(range(i, i + found.span)))
        elsewhere = len(marked - inside)
        if runs >= NAMED_ON * len(found.starts) and elsewhere <= NAMED_ELSEWHERE * max(1, others):
            seen.append(kind)
    return tuple(seen)


def epoch_cost(records: Sequence[StepRecord], epoch_starts: Sequence[int]) -> Periodic | None:
    """What restarting the workers costs an epoch: the epoch-start steps' excess over the other steps' mean, whether
    they stand out or not (`stands_out` says), the steps after them left among the others (module doc: workers that
    persist fill their queues beside those steps too); None with fewer than `MIN_EPOCH_STARTS` epoch starts, or
    fewer than `MIN_STEPS` steps."""
    totals = [r.total_s for r in records]
    starts = sorted({i for i in epoch_starts if 0 <= i < len(totals)})
    if len(totals) < MIN_STEPS or len(starts) < MIN_EPOCH_STARTS:
        return None
    return _at(totals, starts, _period(starts), epoch=True, required=False, longest=1)


def _period(starts: list[int]) -> int:
    """Steps per epoch from the gaps between epoch starts (their median: a step left out of the records, an
    evaluation pass's, shortens one gap)."""
    return max(1, round(statistics.median(b - a for a, b in itertools.pairwise(starts))))


def _at(totals: list[float], starts: list[int], period: int, *, epoch: bool, required: bool = True,
        longest: int | None = None) -> Periodic | None:
    """The slow runs beginning at `starts`, of `longest` steps at the most: None unless their first steps stand out
    from the others (`required`; else a run of the first step alone when they do not)."""
    if period < 2:
        return None
    span, stands_out = 1, True
    while True:
        others = _others(totals, starts, span)
        if len(others) < 2:
            return None
        first = statistics.median(totals[i] for i in starts)
        if span == 1:
            stands_out = (first > percentile(others, 90)
                          and first >= (EPOCH_SLOW if epoch else SLOW) * statistics.median(others))
            if not stands_out:
                if required:
                    return None
                break
        if span >= period - 1 or (longest is not None and span >= longest):
            break
        following = [totals[i + span] for i in starts if i + span < len(totals)]
        candidates = _others(totals, starts, span + 1)
        if (len(following) < 2 or len(candidates) < 2
                or not statistics.median(following) > percentile(candidates, 90)):
            break
        span += 1
    others = _others(totals, starts, span)
    mean = statistics.fmean(others)
    # whole runs only: one cut short by the window's end would understate the excess
    runs = [sum(totals[i:i + span]) - mean * span for i in starts if i + span <= len(totals)]
    return Periodic(period=period, starts=tuple(starts), span=span, epoch_starts=epoch, slow_s=first,
                    typical_s=statistics.median(others), other_mean_s=mean, other_p10_s=percentile(others, 10),
                    other_p90_s=percentile(others, 90), excess_s=max(0.0, statistics.fmean(runs)) if runs else 0.0,
                    stands_out=stands_out)


def _others(totals: list[float], starts: list[int], span: int) -> list[float]:
    """The step times outside the runs of `span` steps beginning at `starts`."""
    inside = {i + k for i in starts for k in range(span)}
    return [t for i, t in enumerate(totals) if i not in inside]


def _every_nth(totals: list[float]) -> Periodic | None:
    """Slow steps (`SLOW` x the median) on a lattice: the smallest period N, from an offset where a run of slow steps
    begins, whose steps (`MIN_RUNS` or more) are nearly all slow (`ON_LATTICE`) and hold nearly all the runs' first
    steps (a noisy step off the lattice, or one on it that was not slow, leaves the period standing)."""
    typical = statistics.median(totals)
    slow = {i for i, t in enumerate(totals) if t >= SLOW * typical}
    starts = sorted(i for i in slow if i - 1 not in slow)
    if len(starts) < MIN_RUNS:
        return None
    for period in range(2, (len(totals) - 1) // (MIN_RUNS - 1) + 1):  # (the lattice's check says if it fits)
        for offset in sorted({i % period for i in starts}):
            lattice = list(range(offset, len(totals), period))
            on = sum(1 for i in lattice if i in slow)
            if (len(lattice) >= MIN_RUNS and on >= ON_LATTICE * len(lattice)
                    and sum(1 for i in starts if i % period == offset) >= ON_LATTICE * len(starts)):
                return _at(totals, lattice, period, epoch=False)
    return None


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _seconds(s: float, in_seconds: bool) -> str:
    return f"{s:.2f} s" if in_seconds else f"{s * 1e3:.0f} ms"
