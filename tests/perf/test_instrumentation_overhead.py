"""The doctor's hooks cost a small, bounded share of the smallest realistic training step (tqdm-style
relative test).

The hooks' cost is measured where it is not drowned by noise: a loop whose step is almost nothing but what the
hooks see (a batch fetched, a one-parameter model called, a backward, an optimizer step), plain vs
instrumented, each the fastest of many short runs. It is then compared with a real, tiny step measured the same
way in the same run. Measured here: 15-20 us per step, 3.0-3.9 % of a 0.5 ms Linear(32, 10) step (0.3 % of a
5 ms one); the 1 % goal is not met (BENCHMARKS.md), and the full-size twin (`make stress`) holds the line at 4 %
(4.8-6.0 % was measured when every step took a median of the last 100 steps and searched each list batch for
ragged tensors).

That line is a benchmark's, not a bound load leaves alone: with two busy loops beside it on 2 cores, 40 pairs took
110 s a run and measured 2.7-5.5 %. `make test` runs the small twin, 6 pairs (up to three times), against a bound
five times the figures measured under that load: it fails where the hooks cost several times what they do, not
where the machine is busy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "doctor_overhead.py"
BOUND = 0.04  # the full-size twin's line (BENCHMARKS.md)
GROSS = 0.25  # the small twin's: several times the cost measured on a busy machine


def measure(out: Path, pairs: int) -> dict:
    """One run of the benchmark, as `python benchmarks/doctor_overhead.py` runs it (1 thread), in a process of its
    own: a script's heap, not the test session's, which makes every scan for the model several times slower and
    leaves the session's other threads beside it."""
    done = subprocess.run([sys.executable, str(BENCHMARK), "--pairs", str(pairs), "--json", str(out)],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def best_of_three(tmp_path: Path, pairs: int, bound: float) -> tuple[dict, list[dict]]:
    """Noise on a shared machine only ever adds time: up to three runs, stopping at one under `bound`; the best one
    counts (a statistical claim about the hooks' own cost, which the fastest runs approach). Returns it and all."""
    results = []
    for attempt in range(3):
        results.append(measure(tmp_path / f"{pairs}-{attempt}.json", pairs=pairs))
        if results[-1]["hook_cost_fraction"] < bound:
            break
    return min(results, key=lambda r: r["hook_cost_fraction"]), results


@pytest.mark.slow
def test_hooks_cost_a_bounded_share_of_a_tiny_step(tmp_path: Path) -> None:
    best, results = best_of_three(tmp_path, 6, GROSS)  # with another test's processes beside it, one run measured 29 %
    assert best["pairs"] == 6 and best["tiny_step_us"] > 0 and best["discovery_ms"] > 0, best
    assert best["hook_cost_us"] < GROSS * best["tiny_step_us"], results


@pytest.mark.slow
@pytest.mark.stress
@pytest.mark.timeout(540)
def test_hooks_cost_under_four_percent_of_a_tiny_step(tmp_path: Path) -> None:
    best, results = best_of_three(tmp_path, 40, BOUND)
    assert best["hook_cost_us"] < BOUND * best["tiny_step_us"], results
