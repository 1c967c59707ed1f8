"""`trainfast.bench.peak`: a block's peak memory on the CPU, from the kernel's peak-RSS counter or sampled RSS."""

from __future__ import annotations

import pytest
import torch

from trainfast.bench import peak
from trainfast.bench.peak import PeakMemory

CPU = torch.device("cpu")
MIB = 2**20


def touch(n_bytes: int) -> torch.Tensor:
    return torch.ones(n_bytes // 4, dtype=torch.float32)  # written, so its pages are resident


def test_the_kernel_counter_keeps_a_peak_freed_before_the_end() -> None:
    if not peak._reset_peak_rss():
        pytest.skip("the peak-RSS counter cannot be reset here (no /proc/self/clear_refs)")
    with PeakMemory(CPU) as p:
        x = touch(64 * MIB)
        del x
    assert (p.source, p.method) == ("rss", "vmhwm")
    assert p.peak_bytes is not None and p.peak_bytes >= 32 * MIB


def test_without_the_kernel_counter_rss_is_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak, "_reset_peak_rss", lambda: False)
    with PeakMemory(CPU) as p:
        x = touch(64 * MIB)
    assert (p.source, p.method) == ("rss", "sampled")
    assert p.peak_bytes is not None and p.peak_bytes >= 32 * MIB  # still held at the end: RSS on exit counts it
    del x
