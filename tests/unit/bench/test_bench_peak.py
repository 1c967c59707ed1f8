"""`trainfast.bench.peak`: a block's peak memory on the CPU, from the kernel's peak-RSS counter or sampled RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest

MIB = 2**20
# Each block runs in a fresh process: in a long test process, freed memory the allocator kept resident can serve
# the 64 MiB, and then RSS does not move. The ones() are written, so their pages are resident.
PEAK_FREED_BEFORE_THE_END = """
import torch
from trainfast.bench import peak
from trainfast.bench.peak import PeakMemory
if not peak._reset_peak_rss():
    print("no-reset")
else:
    with PeakMemory(torch.device("cpu")) as p:
        x = torch.ones(64 * 2**20 // 4)
        del x
    print(p.source, p.method, p.peak_bytes)
"""


@pytest.mark.slow
def test_the_kernel_counter_keeps_a_peak_freed_before_the_end() -> None:
    out = subprocess.run([sys.executable, "-c", PEAK_FREED_BEFORE_THE_END], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    if out == ["no-reset"]:
        pytest.skip("the peak-RSS counter cannot be reset here (no /proc/self/clear_refs)")
    source, method, peak_bytes = out
    assert (source, method) == ("rss", "vmhwm")
    assert int(peak_bytes) >= 32 * MIB


PEAK_SAMPLED = """
import torch
from trainfast.bench import peak
from trainfast.bench.peak import PeakMemory
peak._reset_peak_rss = lambda: False  # as where /proc/self/clear_refs is missing
with PeakMemory(torch.device("cpu")) as p:
    x = torch.ones(64 * 2**20 // 4)
print(p.source, p.method, p.peak_bytes)
"""


@pytest.mark.slow
def test_without_the_kernel_counter_rss_is_sampled() -> None:
    out = subprocess.run([sys.executable, "-c", PEAK_SAMPLED], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    source, method, peak_bytes = out
    assert (source, method) == ("rss", "sampled")
    assert int(peak_bytes) >= 32 * MIB  # still held at the end: RSS on exit counts it
