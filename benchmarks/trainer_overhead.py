"""Trainer.fit vs the same loop written by hand: what the Trainer's machinery costs per step.

Both train the same Linear(32, 10) on the same in-memory data through the same DataLoader
(TensorDataset, batch 64, shuffled), with AdamW, a warm-up cosine schedule, fp32 and one thread; the
raw loop keeps a running loss on the device like the Trainer does. Clipping is off in both. Runs are
interleaved; the overhead is the median of the per-round time ratios minus one, of two figures:
  - per step: the mean step after the Trainer's warm-up steps (WARMUP_STEPS, the first of which counts the
    model's FLOPs), each step timed as the Trainer's own clock times it (from the last step's end, each epoch
    from its first batch's request), the hand-written loop timed the same way by a `perf_counter` per step;
  - the whole fit: everything `fit()` does, its start-up, its FLOP-counting step and its end included, against
    the whole hand-written loop; the difference less the steps' is the work around the steps.

    python benchmarks/trainer_overhead.py --json trainer_overhead.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfast import TrainConfig, Trainer
from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave
from trainfast.trainer.clock import WARMUP_STEPS
from trainfast.trainer.optimizer import default_optimizer
from trainfast.trainer.schedule import warmup_cosine


def make_data(samples: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))


Timed = tuple[float, list[float]]  # the whole run's seconds, each step's


def raw_loop(loader: DataLoader[Any], epochs: int) -> Timed:
    torch.manual_seed(0)
    model = nn.Linear(32, 10)
    optimizer = default_optimizer(model, 2e-3, 0.05, torch.device("cpu"))
    started = time.perf_counter()
    scheduler = warmup_cosine(optimizer, 20, epochs * len(loader))
    running = torch.zeros(())
    steps: list[float] = []
    for _ in range(epochs):
        batches = iter(loader)
        last = time.perf_counter()  # as the Trainer's clock: each epoch's steps from its first batch's request
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            running += loss.detach()
            now = time.perf_counter()
            steps.append(now - last)
            last = now
        float(running)  # read once per epoch, as the Trainer does
    return time.perf_counter() - started, steps


def trainer_fit(loader: DataLoader[Any], epochs: int) -> Timed:
    torch.manual_seed(0)
    model = nn.Linear(32, 10)
    # fp32, NCHW and one thread pinned, as the raw loop runs: "auto" would A/B bf16 on a CPU that has it and take
    # every core for intra-op threads (another step)
    trainer = Trainer(model, config=TrainConfig(epochs=epochs, grad_clip=None, progress=False, log_every=10_000,
                                                device="cpu", precision="32-true", channels_last=False, cpu_threads=1))
    started = time.perf_counter()
    trainer.fit(loader)
    return time.perf_counter() - started, list(trainer.clock.step_s)


def steady(steps: list[float]) -> float:
    """The mean step after the Trainer's warm-up steps."""
    return statistics.fmean(steps[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64 * 150, help="samples per epoch (64 per step)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    loader = make_data(args.samples)
    steps = args.epochs * len(loader)
    runs: dict[str, list[Timed]] = {"raw": [], "trainer": []}
    variants = {"raw": lambda: _keep(runs["raw"], raw_loop(loader, args.epochs)),
                "trainer": lambda: _keep(runs["trainer"], trainer_fit(loader, args.epochs))}
    interleave(variants, repeats=args.repeats, warmup=2)
    raw, trainer = runs["raw"][-args.repeats:], runs["trainer"][-args.repeats:]
    per_step = Spread.of([steady(t[1]) / steady(r[1]) - 1 for t, r in zip(trainer, raw, strict=True)])
    overhead = Spread.of([t[0] / r[0] - 1 for t, r in zip(trainer, raw, strict=True)])
    raw_us, trainer_us = (Spread.of([steady(run[1]) * 1e6 for run in side]) for side in (raw, trainer))
    around = Spread.of([1e3 * ((t[0] - sum(t[1])) - (r[0] - sum(r[1]))) for t, r in zip(trainer, raw, strict=True)])
    report = {"per_step_overhead": per_step.median, "per_step_overhead_spread": per_step.to_json(),
              "fit_overhead": overhead.median, "fit_overhead_spread": overhead.to_json(),
              "around_steps_ms": around.to_json(), "raw_step_us": raw_us.to_json(),
              "trainer_step_us": trainer_us.to_json(), "steps_per_run": steps, "warmup_steps": WARMUP_STEPS,
              "repeats": args.repeats, "goal": 0.01, "hardware": hardware()}
    print(f"{describe(report['hardware'])}, 1 thread, {steps} steps a run, {args.repeats} interleaved pairs")
    print(f"raw loop     {raw_us.median:7.1f} us/step (p25-p75 {raw_us.low:.1f}-{raw_us.high:.1f})")
    print(f"Trainer.fit  {trainer_us.median:7.1f} us/step (p25-p75 {trainer_us.low:.1f}-{trainer_us.high:.1f})")
    print(f"per step     {per_step.median:+.2%} median of the pairs (p25-p75 {per_step.low:+.2%} to "
          f"{per_step.high:+.2%}); goal <= +1%")
    print(f"whole fit    {overhead.median:+.2%} (p25-p75 {overhead.low:+.2%} to {overhead.high:+.2%}); the work "
          f"around the steps {around.median:+.1f} ms a fit beyond the loop's (p25-p75 {around.low:+.1f} to "
          f"{around.high:+.1f})")
    if args.json:
        write_json(args.json, report)


def _keep(into: list[Timed], timed: Timed) -> float:
    into.append(timed)
    return timed[0]


if __name__ == "__main__":
    main()
