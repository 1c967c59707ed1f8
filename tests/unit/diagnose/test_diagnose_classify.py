"""The verdict table: each verdict from the fractions (and GPU utilisation / loader headroom) that imply it."""

from __future__ import annotations

import pytest

from trainfast.diagnose.classify import (
    COMPUTE_BOUND,
    DATA_WAIT_BOUND,
    HOST_BOUND,
    TRANSFER_BOUND,
    Fractions,
    classify,
)


def f(wait: float = 0.0, transfer: float = 0.0, host: float = 0.0) -> Fractions:
    return Fractions(wait, transfer, host, 1 - wait - transfer - host)


@pytest.mark.parametrize(("fractions", "device", "gpu_util", "headroom", "verdict"), [
    (f(wait=0.58), "cpu", None, None, "input-bound"),                      # the seeds' "before": 58 % data wait
    (f(wait=DATA_WAIT_BOUND + 0.01), "cuda", 95.0, None, "input-bound"),    # just over the profiler plugin's 5 %
    (f(wait=DATA_WAIT_BOUND), "cpu", None, None, "compute-bound"),          # at the bar: not flagged
    (f(transfer=0.3, wait=0.1), "cuda", None, None, "transfer-bound"),      # the largest waste wins
    (f(transfer=TRANSFER_BOUND), "cuda", None, None, "compute-bound"),
    (f(host=0.35), "cpu", None, None, "host-bound"),
    (f(host=0.3, wait=0.06), "cpu", None, None, "host-bound"),
    (f(host=HOST_BOUND), "cpu", None, None, "balanced"),                    # 80 % compute: below 85 %
    (f(), "cuda", 30.0, None, "host-bound"),                                # busy GPU-side compute share, idle GPU
    (f(), "cuda", 97.0, None, "compute-bound"),
    (f(), "cpu", 30.0, None, "compute-bound"),                              # GPU utilisation means nothing on CPU
    (f(host=0.12, wait=0.04), "cpu", None, None, "balanced"),
    (f(wait=0.01), "cpu", None, 1.05, "input-bound"),                       # DALI: headroom <= 1.1 is certain
    (f(wait=0.01), "cpu", None, 1.3, "compute-bound"),
    (f(wait=0.07), "cpu", None, 200.0, "compute-bound"),                    # a 200x faster loader: wait is jitter
    (f(wait=0.07), "cpu", None, 1.2, "input-bound"),
])
def test_verdicts(fractions: Fractions, device: str, gpu_util: float | None, headroom: float | None,
                  verdict: str) -> None:
    assert classify(fractions, device=device, gpu_util=gpu_util, loader_headroom=headroom).name == verdict


def test_reasons_carry_the_numbers() -> None:
    reason = classify(f(wait=0.58), device="cpu").reason
    assert "58% of each step" in reason and "compute 42%" in reason
    assert "the model step on the CPU" in classify(f(), device="cpu").reason
    assert "1.05x" in classify(f(), device="cpu", loader_headroom=1.05).reason
    assert "possible bottleneck" in classify(f(host=0.12, wait=0.04), device="cpu", loader_headroom=1.3).reason


def test_fractions_of_totals() -> None:
    fr = Fractions.of(total_s=10, wait_s=5, transfer_s=1, host_s=2)
    assert (fr.data_wait, fr.transfer, fr.host) == (0.5, 0.1, 0.2) and fr.compute == pytest.approx(0.2)
    assert Fractions.of(total_s=0, wait_s=0, transfer_s=0, host_s=0).compute == 0
    assert set(fr.to_json()) == {"data_wait", "transfer", "host", "compute"}
    assert COMPUTE_BOUND > 0.5
