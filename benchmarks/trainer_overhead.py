"""Trainer.fit vs the same loop written by hand: what the Trainer's machinery costs per step.

Both train the same Linear(32, 10) on the same in-memory data through the same DataLoader
(TensorDataset, batch 64, shuffled), with AdamW, a warm-up cosine schedule, fp32 and one thread; the
raw loop keeps a running loss on the device like the Trainer does. Clipping is off in both. Runs are
interleaved; the overhead is the median of the per-round time ratios minus one.

    python benchmarks/trainer_overhead.py --json trainer_overhead.json
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainfast import TrainConfig, Trainer
from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios
from trainfast.trainer.optimizer import default_optimizer
from trainfast.trainer.schedule import warmup_cosine


def make_data(samples: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(samples, 32, generator=g), torch.randint(0, 10, (samples,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))


def raw_loop(loader: DataLoader[Any], epochs: int) -> float:
    torch.manual_seed(0)
    model = nn.Linear(32, 10)
    optimizer = default_optimizer(model, 2e-3, 0.05, torch.device("cpu"))
    started = time.perf_counter()
    scheduler = warmup_cosine(optimizer, 20, epochs * len(loader))
    running = torch.zeros(())
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            running += loss.detach()
        float(running)  # read once per epoch, as the Trainer does
    return time.perf_counter() - started


def trainer_fit(loader: DataLoader[Any], epochs: int) -> float:
    torch.manual_seed(0)
    model = nn.Linear(32, 10)
    # fp32, NCHW and one thread pinned, as the raw loop runs: "auto" would A/B bf16 on a CPU that has it and take
    # every core for intra-op threads (another step)
    trainer = Trainer(model, config=TrainConfig(epochs=epochs, grad_clip=None, progress=False, log_every=10_000,
                                                device="cpu", precision="32-true", channels_last=False, cpu_threads=1))
    started = time.perf_counter()
    trainer.fit(loader)
    return time.perf_counter() - started


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
    variants = {"raw": lambda: raw_loop(loader, args.epochs), "trainer": lambda: trainer_fit(loader, args.epochs)}
    times = interleave(variants, repeats=args.repeats, warmup=2)
    overhead = Spread.of([r - 1 for r in ratios(times["trainer"], times["raw"])])
    raw_us, trainer_us = (Spread.of([t / steps * 1e6 for t in times[k]]) for k in ("raw", "trainer"))
    of_medians = trainer_us.median / raw_us.median - 1
    report = {"overhead": overhead.median, "overhead_spread": overhead.to_json(), "overhead_of_medians": of_medians,
              "raw_step_us": raw_us.to_json(), "trainer_step_us": trainer_us.to_json(),
              "trainer_extra_us_per_step": trainer_us.median - raw_us.median, "steps_per_run": steps,
              "repeats": args.repeats, "goal": 0.01, "hardware": hardware()}
    print(f"{describe(report['hardware'])}, 1 thread")
    print(f"raw loop     {raw_us.median:7.1f} us/step (p25-p75 {raw_us.low:.1f}-{raw_us.high:.1f})")
    print(f"Trainer.fit  {trainer_us.median:7.1f} us/step (p25-p75 {trainer_us.low:.1f}-{trainer_us.high:.1f})")
    print(f"overhead     {overhead.median:+.2%} median of {args.repeats} interleaved pairs "
          f"(p25-p75 {overhead.low:+.2%} to {overhead.high:+.2%}); ratio of medians {of_medians:+.2%}; "
          f"{trainer_us.median - raw_us.median:+.1f} us/step; goal <= +1%")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
