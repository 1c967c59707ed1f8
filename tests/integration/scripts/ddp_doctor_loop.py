"""A plain DDP loop on gloo for `torchrun ... -m trainfast doctor` (no trainfast in it): rank 1 is slower, its
dataset sleeps per sample. Each rank writes how many optimizer steps it took to OUT/rank{r}.json on the way out,
however the doctor stops it.

usage: ddp_doctor_loop.py OUT [--steps N] [--delay S]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, delay_s: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=generator), torch.randn(n, 1, generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--delay", type=float, default=0.001, help="seconds per sample on rank 1")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Points(4096, args.delay if rank == 1 else 0.0)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0), drop_last=True)
    steps = 0
    try:
        for epoch in range(10_000):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
                if steps >= args.steps:
                    return
    finally:  # also when the doctor's stop unwinds the loop
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps({"steps": steps, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
