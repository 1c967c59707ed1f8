"""The one home for "is B faster than A": paired samples, an interval that holds their noise, a decision that says
its doubt.

Every caller that chooses between two settings by measuring them decides here: `--verify` (each fix and the set),
`compare` (reports, and `--runs`), the Trainer's practices, the tuner's confirmation, the doctor's trials of
candidate fixes and the FSDP2 trial (`decide_rounds`, from the summary a trial keeps), the JPEG backend's pick.
Nothing else decides faster or slower by a rule of its own.

The samples. A and B are measured in turn, interleaved A B B A A B ... (the second of a pair inherits a warmer
cache and a hotter core, so the order alternates), and each adjacent (A, B) is a pair: its log ratio log(B / A) cancels
the drift the two share. What one pair cannot cancel, the machine's swing from one run to the next, is the spread
*between* pairs, and that is the spread the interval is made of: a run's own steps know nothing of it.

The interval. The estimate is the median of the pairs' log ratios (a stalled run moves it by one rank, not by its
size). Its standard error is s * sqrt(pi / 2) / sqrt(n) (the median's, under normal noise; s / sqrt(n) for n <= 2,
where median and mean agree), with s the pairs' spread pooled with a prior, the noise this kind of measurement has
on this machine class (`Noise`: an sd and a weight in pairs): s^2 = (w * prior^2 + (n - 1) * sd^2) / (w + n - 1),
on w + n - 1 degrees of freedom. The prior keeps two pairs that happen to agree from claiming a tight interval; as
pairs arrive, their own spread takes over. The interval is Student's t on those degrees of freedom at `CONFIDENCE`
(two-sided, 96 %), split over the looks a sequential rule takes (Bonferroni: each look at 1 - (1 - c) / looks, so
that stopping at the first decided look keeps the error rate).

The decision, against a threshold T (a ratio >= 1: "3 % faster" is 1.03):
- faster: B's speed is significantly above A's (the interval's low end above 1) and the estimate is at least T;
- slower: the mirror (high end below 1, estimate at most 1 / T);
- same: the interval lies inside (1 / T, T): neither faster nor slower by T;
- inconclusive: anything else. "Cannot tell" is an answer: more pairs, or a quieter machine, narrow it.
`detectable` is the smallest change these pairs could tell from none (the interval's half-width, as a ratio), and
`pairs_needed` how many pairs at this noise would tell T from none.

A stalled sample, more than `STALL` (15 %) slower than the median of its side, is set aside (with 3 or more a side;
paired, with its pair), and counted: other processes taking the cores for one run are not the script's speed.

One run a side has no spread of its own: the interval is then the prior's alone, which at `RUN_NOISE` is +-47 %
(`drift_bound`): a change beyond what run-to-run drift here can be. Unpaired sides (several reports a side, measured
apart) compare medians, with both sides' spreads (`paired=False`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

Verdict = Literal["faster", "slower", "same", "inconclusive"]

FASTER = 1.03  # the default threshold: a choice is kept only when 3 % faster (two runs of one step here differ ~3 %)
WITHIN = FASTER - 1  # 0.03: the tuner's ranking tolerance (settings this close count as equally fast)
# Two-sided, split over a sequential rule's looks: by the union bound a false "slower" (or "faster") in at most 2 % of
# decisions; simulated at this machine's noise (tests/unit/test_decide.py), under 0.5 %: looks at growing samples
# are correlated, so the bound is loose.
CONFIDENCE = 0.96


@dataclass(frozen=True)
class Noise:
    """A prior on the spread of a pair's log ratio: `sd` (0.05: adjacent measurements differ by ~5 %), worth
    `weight` pairs of data."""

    sd: float
    weight: float


# Runs of a whole script (a doctor report, a verify child): on these 2-core machines adjacent runs of one unchanged
# script differ by up to 25 %, and verify's baselines drifted -32 %/+35 % within a minute. With no spread of its
# own (one pair), a change is decided only beyond +-47 % (`drift_bound`): 0.08 x t(2 df, 98 %) = 0.39 = log 1.47.
RUN_NOISE = Noise(0.08, 2.0)
# A sample more than 15 % slower than its side's median is set aside as stalled (with 3 or more a side): a doctor run
# of one unchanged script here stalls so about 1 run in 8 (662 samples/s beside 820-897), as far as a 15 % change.
STALL = 0.15
# Adjacent measurements inside one process (the Trainer's A/Bs, a replay's rounds, the FSDP2 trial's pairs of
# steps, the tuner's rounds, the JPEG backends): ~5 % apart
# on a quiet 2-core CPU, tens of percent under load; worth 2 pairs, so the steps' own spread soon rules.
STEP_NOISE = Noise(0.05, 2.0)


@dataclass(frozen=True)
class Decision:
    """B against A: `ratio` B's speed over A's (> 1: B faster), its interval, the verdict against `threshold`."""

    ratio: float
    low: float
    high: float
    pairs: int  # pairs (paired), or the smaller side's runs (unpaired)
    threshold: float
    verdict: Verdict
    detectable: float  # the smallest ratio (>= 1) these samples could tell from 1
    pairs_needed: int | None  # pairs at this noise that would tell `threshold` from 1 (None: beyond any budget)
    confidence: float
    sd: float  # the pooled spread of a pair's log ratio
    set_aside: int = 0  # samples left out as stalled (`STALL`): a pair with either side stalled counts once

    @property
    def faster(self) -> bool:
        return self.verdict == "faster"

    @property
    def slower(self) -> bool:
        return self.verdict == "slower"

    @property
    def decided(self) -> bool:
        return self.verdict != "inconclusive"

    @property
    def no_gain(self) -> bool:
        """B is not faster than A by `threshold`: the interval's high end is below it."""
        return self.high < self.threshold

    def interval(self) -> str:
        """"1.12x (1.04-1.21x, 96 %, 5 pairs)"."""
        return (f"{self.ratio:.2f}x ({self.low:.2f}-{self.high:.2f}x, {self.confidence:.0%}, {self.pairs} "
                f"pair{'s' if self.pairs != 1 else ''})")

    def said(self, a: str = "A", b: str = "B") -> str:
        """The decision in words: "B is faster than A: 1.12x (1.04-1.21x, 96 %, 5 pairs)"."""
        t = f"{self.threshold:g}x"
        words = {"faster": f"{b} is faster than {a}", "slower": f"{b} is slower than {a}",
                 "same": f"{b} is within {t} of {a}",
                 "inconclusive": f"cannot tell {b} from {a} at {t} (changes under {self.detectable:.2f}x are within "
                                 "the noise" + (f"; ~{self.pairs_needed} pairs would tell" if self.pairs_needed
                                                else "") + ")"}
        return f"{words[self.verdict]}: {self.interval()}"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ratio": self.ratio, "low": self.low, "high": self.high, "pairs": self.pairs,
                "threshold": self.threshold, "detectable": self.detectable, "pairs_needed": self.pairs_needed,
                "confidence": self.confidence, "sd": self.sd, "set_aside": self.set_aside}


def decide(a: Sequence[float], b: Sequence[float], *, threshold: float = FASTER, noise: Noise = RUN_NOISE,
           paired: bool = True, looks: int = 1, confidence: float = CONFIDENCE,
           null_pairs: Sequence[tuple[float, float]] = ()) -> Decision:
    """B against A from their speeds (higher is faster: samples/s, or 1 / seconds), paired in order (`a[i]` beside
    `b[i]`) or, with `paired=False`, two independent samples. `looks`: how many times a sequential rule looks at
    growing samples (module doc). `null_pairs`: pairs of one setting measured twice (verify's baselines before and
    after), whose log ratios show the spread a pair has with no change: each adds a degree of freedom to the spread
    (paired only). Raises ValueError on no samples, unequal pairs, or a speed that is not > 0."""
    if threshold < 1:
        raise ValueError(f"threshold={threshold!r}: give a ratio of 1 or more (1.05: 5 % faster)")
    if not a or not b or (paired and len(a) != len(b)):
        raise ValueError(f"{len(a)} and {len(b)} samples: give at least one a side" + (", as many a side when "
                                                                                      "paired" if paired else ""))
    if any(not (x > 0 and math.isfinite(x)) for x in (*a, *b)):
        raise ValueError("a speed that is not a positive number: a failed or stalled run has no speed; leave it out")
    level = 1 - (1 - confidence) / (2 * max(1, looks))  # each side's share of the two-sided level
    kept_a, kept_b = _unstalled(a), _unstalled(b)
    if paired:
        keep = [i for i in range(len(a)) if i in kept_a and i in kept_b] or list(range(len(a)))
        aside = len(a) - len(keep)
        a, b = [a[i] for i in keep], [b[i] for i in keep]
    else:
        aside = len(a) + len(b) - len(kept_a) - len(kept_b)
        a, b = [a[i] for i in sorted(kept_a)], [b[i] for i in sorted(kept_b)]
    if paired:
        logs = [math.log(y / x) for x, y in zip(a, b, strict=True)]
        n = len(logs)
        centre = statistics.median(logs)
        nulls = [math.log(y / x) for x, y in null_pairs if x > 0 and y > 0]
        sd, df = _pooled([logs], noise.sd, noise.weight, known_zero=nulls)
        se = sd * _median_factor(n) / math.sqrt(n)
        df_per_pair, df_first = 1, noise.weight + len(nulls)
    else:
        la, lb = [math.log(x) for x in a], [math.log(y) for y in b]
        n = min(len(la), len(lb))
        centre = statistics.median(lb) - statistics.median(la)
        # a run's own spread is a pair's over sqrt(2): a pair is the difference of two runs
        sd, df = _pooled([la, lb], noise.sd / math.sqrt(2), noise.weight)
        se = sd * math.hypot(*(_median_factor(len(x)) / math.sqrt(len(x)) for x in (la, lb)))
        sd *= math.sqrt(2)
        df_per_pair, df_first = 2, noise.weight
    half = t_quantile(level, df) * se
    low, high = math.exp(centre - half), math.exp(centre + half)
    ratio = math.exp(centre)
    return Decision(ratio, low, high, n, threshold, _verdict(ratio, low, high, threshold), math.exp(half),
                    _needed(threshold, sd, df_first, df_per_pair, level), confidence, sd, aside)


# d2(n): the expected range of n draws of a unit normal (the range method of estimating a spread: sd = range / d2)
_RANGE_D2 = (0.0, 0.0, 1.128, 1.693, 2.059, 2.326, 2.534, 2.704, 2.847, 2.970, 3.078, 3.173, 3.258)


def decide_rounds(median: float, low: float, high: float, rounds: int, *, threshold: float = FASTER,
                  noise: Noise = STEP_NOISE, looks: int = 1, confidence: float = CONFIDENCE) -> Decision:
    """B against A from the summary a trial keeps of its rounds (each a pair): the median of the rounds' ratios
    (B's speed over A's) and their smallest and largest. The spread is the range's (range / d2(n), the range method),
    pooled with the prior as in `decide`; the rest is `decide`'s rule. For a record that keeps no rounds one by one
    (the doctor's trials, the FSDP2 trial)."""
    if rounds < 1 or not 0 < low <= median <= high:
        raise ValueError(f"median={median!r}, low={low!r}, high={high!r} over {rounds} rounds: give low <= median "
                         "<= high, all > 0, and 1 or more rounds")
    level = 1 - (1 - confidence) / (2 * max(1, looks))
    d2 = _RANGE_D2[rounds] if rounds < len(_RANGE_D2) else _RANGE_D2[-1] + 0.8 * math.log(rounds / 12)
    spread = (math.log(high) - math.log(low)) / d2 if rounds > 1 else 0.0
    sd, df = _with_prior(noise.sd, noise.weight, (rounds - 1) * spread ** 2, rounds - 1)
    half = t_quantile(level, df) * sd * _median_factor(rounds) / math.sqrt(rounds)
    centre = math.log(median)
    lo, hi = math.exp(centre - half), math.exp(centre + half)
    return Decision(median, lo, hi, rounds, threshold, _verdict(median, lo, hi, threshold), math.exp(half),
                    _needed(threshold, sd, noise.weight, 1, level), confidence, sd)


def drift_bound(noise: Noise = RUN_NOISE, confidence: float = CONFIDENCE) -> float:
    """The ratio one pair alone must pass to be decided: the prior's interval, with no spread of its own."""
    return math.exp(t_quantile(1 - (1 - confidence) / 2, noise.weight) * noise.sd)


def _unstalled(speeds: Sequence[float]) -> set[int]:
    """The samples not stalled: all of them under 3; else those within `STALL` of the side's median."""
    if len(speeds) < 3:
        return set(range(len(speeds)))
    floor = statistics.median(speeds) * (1 - STALL)
    return {i for i, x in enumerate(speeds) if x >= floor}


def _verdict(ratio: float, low: float, high: float, threshold: float) -> Verdict:
    if low > 1 and ratio >= threshold:
        return "faster"
    if high < 1 and ratio <= 1 / threshold:
        return "slower"
    if 1 / threshold < low and high < threshold:
        return "same"
    return "inconclusive"


def _median_factor(n: int) -> float:
    return math.sqrt(math.pi / 2) if n >= 3 else 1.0


def _pooled(groups: Sequence[Sequence[float]], prior_sd: float, weight: float,
            known_zero: Sequence[float] = ()) -> tuple[float, float]:
    """The groups' spread pooled with the prior (module doc), and its degrees of freedom; `known_zero`: values whose
    mean is 0 by design (a setting against itself), one degree of freedom each."""
    ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in groups if len(g) > 1) + sum(x * x for x in
                                                                                                known_zero)
    return _with_prior(prior_sd, weight, ss, sum(len(g) - 1 for g in groups) + len(known_zero))


def _with_prior(prior_sd: float, weight: float, ss: float, df_data: float) -> tuple[float, float]:
    """A spread from `ss` (sum of squared deviations) on `df_data` degrees of freedom, pooled with the prior worth
    `weight` (module doc), and its degrees of freedom."""
    df = weight + df_data
    return math.sqrt((weight * prior_sd ** 2 + ss) / df), df


def _needed(threshold: float, sd: float, df_first: float, df_per_pair: int, level: float,
            limit: int = 200) -> int | None:
    """The fewest pairs (runs a side, unpaired) whose interval's half-width at the spread `sd` of a pair is under
    log(threshold): a change of `threshold` would then be told from none when measured at its size. The degrees of
    freedom grow by `df_per_pair` a pair from `df_first` at one. The half-width falls as pairs are added, so a
    bisection over 1..`limit` finds it in ~8 quantiles (a decision is made on every look of a Trainer's A/B)."""
    target = math.log(threshold)

    def tells(k: int) -> bool:
        return t_quantile(level, df_first + df_per_pair * (k - 1)) * sd * _median_factor(k) / math.sqrt(k) < target
    if target <= 0 or not tells(limit):
        return None
    low, high = 0, limit  # tells(high) holds; tells(low) does not (no pairs tell nothing)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if tells(mid) else (mid, high)
    return high


# ---------------------------------------------------------------------- the sequential rule
def sequential(sample: Callable[[int], tuple[float, float]], *, first: int, budget: int,
               threshold: float = FASTER, noise: Noise = RUN_NOISE,
               stop: Callable[[Decision], bool] | None = None,
               confidence: float = CONFIDENCE) -> tuple[Decision, list[tuple[float, float]]]:
    """Measure pairs (`sample(i)` -> (A's speed, B's) of pair i, whose order the caller alternates) until the
    decision is made, at least `first` and at most `budget` of them; the decision looks after each pair from the
    `first` on, at the confidence those looks share (module doc). `stop`: when a decision ends the measuring
    (default: any decided verdict). Returns the decision and the pairs."""
    if not 1 <= first <= budget:
        raise ValueError(f"first={first}, budget={budget}: give 1 <= first <= budget")
    looks = budget - first + 1
    done = stop or (lambda d: d.decided)
    pairs: list[tuple[float, float]] = []
    while True:
        pairs.append(sample(len(pairs)))
        if len(pairs) < first:
            continue
        decision = decide([p[0] for p in pairs], [p[1] for p in pairs], threshold=threshold, noise=noise,
                          looks=looks, confidence=confidence)
        if done(decision) or len(pairs) >= budget:
            return decision, pairs


def looks_between(first: int, budget: int) -> int:
    """The looks a sequential rule from `first` to `budget` pairs takes (for a caller that drives its own loop, as
    the Trainer does, a step at a time)."""
    return max(1, budget - first + 1)


# ---------------------------------------------------------------------- Student's t, without scipy
@lru_cache(maxsize=512)
def t_quantile(p: float, df: float) -> float:
    """The `p` quantile (p > 0.5) of Student's t with `df` degrees of freedom: the CDF integrated (Simpson) and
    bisected; exact to ~1e-6 (tests/unit/test_decide.py holds it against the tables), ~1 ms."""
    if not 0.5 < p < 1:
        raise ValueError(f"p={p!r}: give 0.5 < p < 1")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _t_cdf(x: float, df: float) -> float:
    # substitute u = atan(t / sqrt(df)): the density becomes cos(u)^(df - 1) times a constant, smooth on [0, pi/2)
    const = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    top = math.atan(x / math.sqrt(df))
    steps = 64  # the integrand is smooth on [0, top]: Simpson's error at 64 intervals is ~1e-9 here
    h = top / steps
    total = sum((1 if i in (0, steps) else 4 if i % 2 else 2) * math.pow(math.cos(i * h), df - 1)
                for i in range(steps + 1))
    return 0.5 + const * total * h / 3


__all__ = ["CONFIDENCE", "FASTER", "RUN_NOISE", "STALL", "STEP_NOISE", "WITHIN", "Decision", "Noise", "Verdict",
           "decide", "decide_rounds", "drift_bound", "looks_between", "sequential", "t_quantile"]
