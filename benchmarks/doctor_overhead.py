"""What the doctor's instrumentation costs a training step.

Two measurements, one thread, each as adjacent pairs of short runs (plain, then instrumented, alternating
which goes first), so that the machine's speed, which drops here in bursts of a second or two, is the same for
both halves of a pair, and many runs find the quiet moments between bursts. Each run warms up first; an
instrumented run's warm-up also finds the model (a one-off scan of the garbage collector's objects, reported
apart as `discovery_ms`):
  - per-step cost of the hooks alone: a loop whose step is a one-parameter model's forward, backward and SGD
    update over a DataLoader of ready batches, plain vs instrumented: the difference of their fastest runs;
  - the smallest realistic step, Linear(32, 10) on a DataLoader over a TensorDataset (batch 64), plain vs
    instrumented: its fastest plain run is the step the cost is compared with, and the pairs give the
    loop's overhead end to end.

    python benchmarks/doctor_overhead.py --json doctor_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.model_hook import root_modules
from trainfast.diagnose.capture.timeline import Timeline

WARMUP_STEPS = 10  # enough for the instrumented run's two model scans (first batch, first step closed)
Loop = Callable[[int], float]  # runs `steps` steps, returns seconds per step


def null_step_loop() -> Loop:
    """A loop that does almost nothing but what the hooks see: fetch a batch, call a one-parameter model,
    backward, step an optimizer."""
    model = nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.zeros(64, 1), torch.zeros(64, dtype=torch.long))

    def run(steps: int) -> float:
        loader = DataLoader([batch] * steps, batch_size=None)
        started = time.perf_counter()
        for x, _ in loader:
            model(x).sum().backward()
            optimizer.step()
        return (time.perf_counter() - started) / steps
    return run


def tiny_training_loop() -> Loop:
    """Linear(32, 10) trained from a per-sample DataLoader, batch 64, AdamW (the smallest realistic step)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(32, 10)
    optimizer = torch.optim.AdamW(model.parameters())

    def run(steps: int) -> float:
        samples = 64 * steps
        data = TensorDataset(torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g))
        loader = DataLoader(data, batch_size=64, shuffle=True)
        started = time.perf_counter()
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - started) / steps
    return run


def plain(run: Loop, steps: int) -> Callable[[], float]:
    def timed() -> float:
        root_modules()  # as the instrumented run scans for the model, which leaves the caches cold
        run(WARMUP_STEPS)
        return run(steps)
    return timed


def instrumented(run: Loop, steps: int) -> Callable[[], float]:
    def timed() -> float:
        with Instrumentation(Timeline(warmup_steps=0)):
            run(WARMUP_STEPS)  # finds the model
            return run(steps)
    return timed


def discovery_ms(repeats: int = 5) -> float:
    """Milliseconds one scan for root modules takes in this process (median)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        root_modules()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(pairs: int, null_steps: int = 100, tiny_steps: int = 40) -> dict[str, Any]:
    null, tiny = null_step_loop(), tiny_training_loop()
    hooks = interleave({"plain": plain(null, null_steps), "instrumented": instrumented(null, null_steps)},
                       repeats=pairs)
    loops = interleave({"plain": plain(tiny, tiny_steps), "instrumented": instrumented(tiny, tiny_steps)},
                       repeats=pairs)
    # Noise here only ever adds time, and comes in bursts: the fastest of many short runs is a loop's own time.
    cost_s = min(hooks["instrumented"]) - min(hooks["plain"])
    step_s = min(loops["plain"])
    paired = Spread.of([(i - p) * 1e6 for i, p in zip(hooks["instrumented"], hooks["plain"], strict=True)])
    return {"hook_cost_us": cost_s * 1e6, "tiny_step_us": step_s * 1e6, "hook_cost_fraction": cost_s / step_s,
            "null_step_us": min(hooks["plain"]) * 1e6, "paired_cost_us": paired.to_json(),
            "tiny_loop_overhead": Spread.of([r - 1 for r in ratios(loops["instrumented"], loops["plain"])]).to_json(),
            "discovery_ms": discovery_ms(), "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = measure(args.pairs) | {"goal": 0.01, "hardware": hardware()}
    print(f"{describe(report['hardware'])}, 1 thread")
    paired = report["paired_cost_us"]
    print(f"hook cost       {report['hook_cost_us']:.1f} us per step, fastest of {args.pairs} runs each (null step "
          f"{report['null_step_us']:.0f} us; paired differences p25-p75 {paired['p25']:.1f} to {paired['p75']:.1f})")
    print(f"                {report['hook_cost_fraction']:.2%} of the {report['tiny_step_us']:.0f} us tiny step; "
          "goal <= 1%")
    print(f"model discovery {report['discovery_ms']:.0f} ms per scan, twice per run (in warm-up)")
    spread = report["tiny_loop_overhead"]
    print(f"tiny loop       {spread['median']:+.2%} median of {args.pairs} adjacent pairs "
          f"(p25-p75 {spread['p25']:+.2%} to {spread['p75']:+.2%})")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
