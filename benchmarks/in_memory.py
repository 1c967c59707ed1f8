"""The in-memory tensor path vs a DataLoader over a TensorDataset (per-sample __getitem__ + collate).

Both iterate one shuffled epoch of the same tensors in the main process (workers only add IPC for
data already in RAM). Reported: batches/s of each, and the median of per-round speed ratios.

    python benchmarks/in_memory.py --json in_memory.json
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainfast import make_loader
from trainfast.atomic import write_json
from trainfast.bench.hardware import describe, hardware
from trainfast.bench.timing import Spread, interleave, ratios


def epoch_time(loader: Any) -> float:
    started = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("trainfast").setLevel(logging.WARNING)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.samples, 3, 32, 32), dtype=torch.uint8, generator=g)  # CIFAR-sized
    y = torch.randint(0, 10, (args.samples,), generator=g)
    dataloader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(0))
    tensor_loader = make_loader((x, y), args.batch_size, shuffle=True)
    batches = len(dataloader)
    times = interleave({"dataloader": lambda: epoch_time(dataloader), "in_memory": lambda: epoch_time(tensor_loader)},
                       repeats=args.repeats)
    speedup = Spread.of(ratios(times["dataloader"], times["in_memory"]))
    rates = {k: Spread.of([batches / t for t in v]) for k, v in times.items()}
    report = {"speedup": speedup.median, "speedup_spread": speedup.to_json(),
              "dataloader_batches_per_s": rates["dataloader"].to_json(),
              "in_memory_batches_per_s": rates["in_memory"].to_json(), "samples": args.samples,
              "batch_size": args.batch_size, "goal": 5.0, "hardware": hardware()}
    print(describe(report["hardware"]))
    print(f"DataLoader(TensorDataset)  {rates['dataloader'].median:9.0f} batches/s")
    print(f"in-memory path             {rates['in_memory'].median:9.0f} batches/s")
    print(f"speedup {speedup.median:.1f}x (median of {args.repeats} interleaved rounds, "
          f"range {speedup.minimum:.1f}-{speedup.maximum:.1f}); goal >= 5x")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
