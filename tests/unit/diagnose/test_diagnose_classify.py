"""The verdict table: each verdict from the fractions (and GPU utilisation / loader headroom / intervals) that
imply it, both sides of every bar."""

from __future__ import annotations

import random

import pytest

from trainfast.diagnose.evidence.noise import share_interval
from trainfast.diagnose.records.steps import Fractions, max_speedup, max_speedups
from trainfast.diagnose.verdict import LIMIT_SHARE, SMALL_SHARE, classify


def f(wait: float = 0.0, transfer: float = 0.0, host: float = 0.0) -> Fractions:
    return Fractions(wait, transfer, host, 1 - wait - transfer - host)


@pytest.mark.parametrize(("fractions", "device", "gpu_util", "headroom", "verdict"), [
    (f(wait=0.58), "cpu", None, None, "input-bound"),                      # the seeds' "before": 58 % data wait
    (f(wait=LIMIT_SHARE), "cuda", 95.0, None, "input-bound"),              # at the bar: 1.33x at stake
    (f(wait=LIMIT_SHARE - 0.01), "cuda", 95.0, None, "balanced"),
    (f(wait=0.10), "cpu", None, None, "compute-bound"),                    # 10 % wait beside 89 % compute
    (f(wait=0.06), "cpu", None, None, "compute-bound"),                    # a GAN's ~5 % wait: not input-bound
    (f(wait=SMALL_SHARE - 0.001), "cpu", None, None, "compute-bound"),
    (f(wait=SMALL_SHARE), "cpu", None, None, "balanced"),
    (f(transfer=0.3, wait=0.26), "cuda", None, None, "transfer-bound"),    # the largest waste wins
    (f(transfer=0.12), "cuda", None, None, "compute-bound"),
    (f(host=0.35), "cpu", None, None, "host-bound"),
    (f(host=0.3, wait=0.06), "cpu", None, None, "host-bound"),
    (f(host=0.2), "cpu", None, None, "balanced"),
    (f(), "cuda", 30.0, None, "host-bound"),                               # busy GPU-side compute share, idle GPU
    (f(), "cuda", 97.0, None, "compute-bound"),
    (f(), "cpu", 30.0, None, "compute-bound"),                             # GPU utilisation means nothing on CPU
    (f(host=0.12, wait=0.04), "cpu", None, None, "compute-bound"),
    (f(wait=0.01), "cpu", None, 1.05, "input-bound"),                      # DALI: headroom <= 1.1 is certain
    (f(wait=0.01), "cpu", None, 1.3, "compute-bound"),
    (f(wait=0.4), "cpu", None, 200.0, "compute-bound"),                    # a 200x faster loader: wait is jitter
    (f(wait=0.2), "cpu", None, 1.2, "balanced"),
])
def test_verdicts(fractions: Fractions, device: str, gpu_util: float | None, headroom: float | None,
                  verdict: str) -> None:
    assert classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=headroom).name == verdict


@pytest.mark.parametrize(("share", "interval", "verdict"), [
    (0.30, (0.27, 0.33), "input-bound"),
    (0.30, (0.20, 0.40), "balanced"),      # could be either side of the bar: not a confident input-bound
    (0.10, (0.08, 0.12), "compute-bound"),
    (0.10, (0.05, 0.18), "balanced"),      # its upper end is no small cost
])
def test_intervals_make_borderline_runs_balanced(share: float, interval: tuple[float, float], verdict: str) -> None:
    intervals = {"data_wait": interval, "transfer": (0.0, 0.0), "host": (0.0, 0.0)}
    assert classify(f(wait=share), device="cpu", intervals=intervals).name == verdict


def test_a_large_but_uncertain_part_is_named_not_called_balanced_silently() -> None:
    """Host 98 % overall, but one step of three holds nearly all of it: the interval's low end is 0."""
    intervals = {"data_wait": (0.0, 0.0), "transfer": (0.0, 0.0), "host": (0.0, 0.99)}
    verdict = classify(f(host=0.98), device="cpu", intervals=intervals)
    assert verdict.name == "balanced" and "no single part dominates" not in verdict.reason
    assert "no part is the limit with confidence: host is 98% of the time overall, 0%-99%" in verdict.reason
    assert "too uneven between steps" in verdict.reason and "--steps" in verdict.reason
    border = classify(f(wait=0.25), device="cpu", intervals={"data_wait": (0.24, 0.27)})
    assert border.name == "balanced" and "data wait is 25% of the time overall, 24%-27%" in border.reason
    assert "close to the bar for the limit (25% of the step)" in border.reason


def test_without_a_loader_the_wait_is_named_for_what_it_is() -> None:
    """No DataLoader to time: the gap before each forward is batch preparation and whatever else runs there."""
    verdict = classify(f(wait=0.36), device="cpu", loader_fed=False)
    assert verdict.name == "input-bound" and "waits for the next batch" not in verdict.reason
    assert "before each forward (no DataLoader to time" in verdict.reason and "EMA update" in verdict.reason
    assert "waits for the next batch" in classify(f(wait=0.36), device="cpu").reason


def test_reasons_carry_the_numbers_and_what_is_at_stake() -> None:
    reason = classify(f(wait=0.58), device="cpu").reason
    assert "58% of each step" in reason and "compute 42%" in reason and "up to 2.38x" in reason
    assert "the model step on the CPU" in classify(f(), device="cpu").reason
    small = classify(f(wait=0.10), device="cpu").reason
    assert "small costs: data wait 10% (<= 1.11x from the input pipeline)" in small
    assert "1.05x" in classify(f(), device="cpu", loader_headroom=1.05).reason
    assert "possible bottleneck" in classify(f(host=0.12, wait=0.08), device="cpu", loader_headroom=1.3).reason
    assert "jitter" in classify(f(wait=0.4), device="cpu", loader_headroom=200.0).reason


def test_max_speedup_is_amdahl() -> None:
    assert max_speedup(0.0) == 1.0 and max_speedup(0.5) == 2.0 and max_speedup(0.1) == pytest.approx(1.111, abs=1e-3)
    assert max_speedup(1.0) == pytest.approx(1000)  # capped: a step that is all wait
    assert set(max_speedups(f(wait=0.2))) == {"data_wait", "transfer", "host", "collection", "communication"}


def test_share_interval_brackets_the_share_and_is_reproducible() -> None:
    rng = random.Random(1)
    totals = [0.1 + rng.random() * 0.01 for _ in range(30)]
    parts = [t * (0.1 + rng.random() * 0.04) for t in totals]
    low, high = share_interval(parts, totals)
    share = sum(parts) / sum(totals)
    assert low < share < high and high - low < 0.03
    assert share_interval(parts, totals) == (low, high)
    assert share_interval([0.5], [1.0]) == (0.5, 0.5)
    with pytest.raises(ValueError, match="one part per step"):
        share_interval([1.0], [])


def test_fractions_of_totals() -> None:
    fr = Fractions.of(total_s=10, wait_s=5, transfer_s=1, host_s=2)
    assert (fr.data_wait, fr.transfer, fr.host) == (0.5, 0.1, 0.2) and fr.compute == pytest.approx(0.2)
    assert Fractions.of(total_s=0, wait_s=0, transfer_s=0, host_s=0).compute == 0
    assert set(fr.to_json()) == {"data_wait", "transfer", "host", "compute", "collection", "communication"}
