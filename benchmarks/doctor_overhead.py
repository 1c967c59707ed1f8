"""What the doctor's instrumentation costs a training step.

Two measurements, interleaved, median of `--repeats` rounds, one thread, each loop timed on its second pass
(the instrumented one's first pass finds the model: a one-off scan, reported as `discovery_ms`):
  - per-step cost of the hooks alone: a loop whose step is a one-parameter model's forward, backward and SGD
    update over a DataLoader of ready batches, plain vs instrumented (the difference of the fastest rounds is
    the hooks' cost);
  - the smallest realistic step, Linear(32, 10) on a DataLoader over a TensorDataset (batch 64), plain vs
    instrumented, as a relative overhead.

    python benchmarks/doctor_overhead.py --json doctor_overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.diagnose.instrument import Instrumentation
from trainfast.diagnose.models import root_modules
from trainfast.diagnose.timeline import Timeline


def null_step_loop(steps: int) -> Any:
    """Seconds per step of a loop that does almost nothing but what the hooks see: fetch a batch, call a
    one-parameter model, backward, step an optimizer."""
    model = nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader([(torch.zeros(64, 1), torch.zeros(64, dtype=torch.long))] * steps, batch_size=None)

    def run() -> float:
        started = time.perf_counter()
        for x, _ in loader:
            model(x).sum().backward()
            optimizer.step()
        return (time.perf_counter() - started) / steps
    return run


def tiny_training_loop(samples: int) -> Any:
    """Seconds per step of Linear(32, 10) trained from a per-sample DataLoader (the smallest realistic step)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g))
    loader = DataLoader(data, batch_size=64, shuffle=True)
    model = nn.Linear(32, 10)
    optimizer = torch.optim.AdamW(model.parameters())

    def run() -> float:
        started = time.perf_counter()
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - started) / len(loader)
    return run


def instrumented(run: Any) -> Any:
    """The loop under instrumentation, timed on its second pass: the one-off model discovery (a scan of the
    garbage collector's objects, measured apart as `discovery_ms`) happens in the first."""
    def wrapped() -> float:
        with Instrumentation(Timeline(warmup_steps=0)):
            run()
            return float(run())
    return wrapped


def twice(run: Any) -> Any:
    def wrapped() -> float:
        run()
        return float(run())
    return wrapped


def discovery_ms(repeats: int = 5) -> float:
    """Milliseconds one scan for root modules takes in this process (median)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        root_modules()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(repeats: int, null_steps: int = 5000, samples: int = 64 * 150) -> dict[str, Any]:
    null, tiny = null_step_loop(null_steps), tiny_training_loop(samples)
    hooks = interleave({"plain": twice(null), "instrumented": instrumented(null)}, repeats=repeats)
    loops = interleave({"plain": twice(tiny), "instrumented": instrumented(tiny)}, repeats=repeats)
    # The minimum of many rounds: the cost is a few microseconds, the noise here is of the same order and
    # only ever adds time.
    cost_s = min(hooks["instrumented"]) - min(hooks["plain"])
    step_s = statistics.median(loops["plain"])
    return {"hook_cost_us": cost_s * 1e6, "tiny_step_us": step_s * 1e6, "hook_cost_fraction": cost_s / step_s,
            "tiny_loop_overhead": Spread.of([r - 1 for r in ratios(loops["instrumented"], loops["plain"])]).to_json(),
            "discovery_ms": discovery_ms(), "repeats": repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = measure(args.repeats) | {"goal": 0.01, "hardware": hardware()}
    print(f"{describe(report['hardware'])}, 1 thread")
    print(f"hook cost       {report['hook_cost_us']:.2f} us per step "
          f"({report['hook_cost_fraction']:.2%} of the {report['tiny_step_us']:.0f} us tiny step); goal <= 1%")
    print(f"model discovery {report['discovery_ms']:.0f} ms once per run (a scan of the gc's objects, in warm-up)")
    spread = report["tiny_loop_overhead"]
    print(f"tiny loop       {spread['median']:+.2%} median of {args.repeats} interleaved pairs "
          f"(p25-p75 {spread['p25']:+.2%} to {spread['p75']:+.2%})")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
