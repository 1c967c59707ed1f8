"""The doctor's hooks cost at most 1 % of the smallest realistic training step (tqdm-style relative test).

The hooks' cost is measured where it is not drowned by noise: a loop whose step is almost nothing, plain
vs instrumented. It is then compared with a real, tiny step measured in the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from doctor_overhead import measure


@pytest.mark.slow
def test_hooks_cost_at_most_one_percent_of_a_tiny_step() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Noise on a shared machine only ever adds time: up to three attempts, the best one counts.
        results = []
        for _ in range(3):
            results.append(measure(repeats=9))
            if results[-1]["hook_cost_fraction"] < 0.01:
                break
    finally:
        torch.set_num_threads(threads)
    best = min(results, key=lambda r: r["hook_cost_fraction"])
    assert best["hook_cost_us"] < 0.01 * best["tiny_step_us"], results
