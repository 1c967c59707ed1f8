"""The one decision ("is B faster than A"): its error rates on simulated noise, and its verdicts table by table."""

from __future__ import annotations

import math
import random

import pytest

from trainfast.decide import (
    FASTER,
    RUN_NOISE,
    STALL,
    STEP_NOISE,
    decide,
    decide_rounds,
    drift_bound,
    looks_between,
    sequential,
    t_quantile,
)


def machine(rng: random.Random, speed: float = 1.0) -> float:
    """One run's speed at this machine's noise: a quiet run within ~3.5 % (an sd of the log), and about 1 run in 8
    stalled by 15-30 % (a doctor run of one unchanged script here: 662 samples/s beside 820-897 in 6 runs)."""
    e = rng.gauss(0.0, 0.035)
    if rng.random() < 0.12:
        e -= rng.uniform(0.15, 0.30)
    return speed * math.exp(e)


def gate(rng: random.Random, slowdown: float) -> tuple[bool, bool, int]:
    """compare --runs' rule on NEW `slowdown` times as slow as BASE: 3 pairs first, up to 12; (slower, passed,
    pairs)."""
    limit = 1.05  # --fail-slower 5
    decision, pairs = sequential(lambda i: (machine(rng), machine(rng, 1 / slowdown)), first=3, budget=12,
                                 threshold=limit, stop=lambda d: d.slower or d.low > 1 / (2 * limit - 1))
    return decision.slower, decision.low > 1 / (2 * limit - 1) and not decision.slower, len(pairs)


def test_same_distribution_pairs_are_almost_never_called_slower() -> None:
    rng = random.Random(7)
    results = [gate(rng, 1.0) for _ in range(400)]
    assert sum(slower for slower, _, _ in results) <= 4  # <= 1 %
    assert sum(passed for _, passed, _ in results) >= 0.4 * len(results)  # and most often it can say so


def test_a_15_percent_slowdown_is_found_within_the_budget() -> None:
    rng = random.Random(11)
    results = [gate(rng, 1.15) for _ in range(400)]
    assert sum(slower for slower, _, _ in results) >= 0.9 * len(results)
    assert not any(passed for _, passed, _ in results)
    assert sum(n for _, _, n in results) / len(results) < 12  # it stops before its budget on average


def test_t_quantiles_match_the_tables() -> None:
    for p, df, table in ((0.975, 1, 12.706), (0.975, 5, 2.571), (0.995, 4, 4.604), (0.99, 30, 2.457)):
        assert t_quantile(p, df) == pytest.approx(table, abs=2e-3)


@pytest.mark.parametrize(("a", "b", "threshold", "verdict"), [
    ([100, 101, 99, 100], [130, 128, 133, 131], FASTER, "faster"),
    ([100, 101, 99, 100], [77, 78, 76, 77], FASTER, "slower"),
    ([100, 101, 99, 100, 100, 99], [100.5, 100.4, 99.2, 100.1, 100.6, 99.3], 1.10, "same"),
    ([100, 101, 99, 100, 100, 99], [100.5, 100.4, 99.2, 100.1, 100.6, 99.3], FASTER, "inconclusive"),  # 3 %: too fine
    ([100, 101], [104, 102], FASTER, "inconclusive"),  # two pairs cannot tell 3 % at this prior
    ([100], [140], FASTER, "inconclusive"),  # one pair: within what run-to-run drift can be
    ([100], [160], FASTER, "faster"),  # beyond it
])
def test_verdicts(a: list[float], b: list[float], threshold: float, verdict: str) -> None:
    assert decide(a, b, threshold=threshold).verdict == verdict


def test_one_pair_decides_only_beyond_the_drift_bound() -> None:
    bound = drift_bound()
    assert 1.4 < bound < 1.55
    assert not decide([100.0], [100.0 * bound * 0.98], threshold=1.05).decided
    assert decide([100.0], [100.0 / (bound * 1.02)], threshold=1.05).slower


def test_null_pairs_measure_the_spread() -> None:
    quiet = decide([100.0], [135.0], null_pairs=[(100.0, 101.0), (99.0, 100.0)])
    noisy = decide([100.0], [135.0], null_pairs=[(100.0, 130.0), (99.0, 75.0)])
    assert quiet.faster and not noisy.decided
    assert noisy.high / noisy.low > quiet.high / quiet.low


def test_a_stalled_sample_is_set_aside() -> None:
    base = [100.0, 99.0, 101.0, 100.0, 100.0]
    stalled = [120.0, 121.0, 119.0, 120.0, 120.0 * (1 - STALL) * 0.8]  # its last run stalled
    d = decide(base, stalled)
    assert d.set_aside == 1 and d.faster and d.ratio == pytest.approx(1.2, rel=0.01)


def test_the_detectable_change_and_pairs_needed_shrink_with_pairs() -> None:
    rng = random.Random(3)
    a = [machine(rng) for _ in range(12)]
    b = [machine(rng) for _ in range(12)]
    few, many = decide(a[:3], b[:3], threshold=1.05), decide(a, b, threshold=1.05)
    assert many.detectable < few.detectable
    assert few.pairs_needed is not None and few.pairs_needed > 3
    assert "cannot tell" in few.said() or few.decided


def test_steps_decide_on_fewer_pairs_than_runs() -> None:
    """A 1.5x step (bf16 against fp32 on a CPU that runs it natively) is decided from 2 pairs of adjacent steps."""
    fp32, bf16 = [1 / 0.150, 1 / 0.152], [1 / 0.100, 1 / 0.101]
    steps = decide(fp32, bf16, noise=STEP_NOISE, looks=looks_between(2, 5))
    runs = decide(fp32, bf16, noise=RUN_NOISE, looks=looks_between(2, 5))
    assert steps.faster and steps.low > runs.low  # a step's prior is the quieter one


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="positive"):
        decide([100.0, 0.0], [100.0, 90.0])
    with pytest.raises(ValueError, match="as many a side"):
        decide([100.0], [100.0, 90.0])
    with pytest.raises(ValueError, match="ratio of 1 or more"):
        decide([100.0], [100.0], threshold=0.9)
    assert FASTER == 1.03


@pytest.mark.parametrize(("median", "low", "high", "verdict"), [
    (2.92, 2.64, 3.11, "faster"),  # bf16 on a CPU that runs it natively, 7 rounds of a replay
    (1.02, 0.90, 1.12, "inconclusive"),
    (0.87, 0.79, 0.92, "slower"),
    (0.91, 0.01, 5.32, "inconclusive"),  # a stalled round: the range says the rounds cannot tell
])
def test_a_trial_is_decided_from_its_rounds_median_and_range(median: float, low: float, high: float,
                                                             verdict: str) -> None:
    assert decide_rounds(median, low, high, 7).verdict == verdict


def test_a_trial_summary_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="give low <= median <= high"):
        decide_rounds(1.0, 1.2, 1.3, 5)
