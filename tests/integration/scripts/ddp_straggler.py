"""A plain DDP loop on gloo for `torchrun ... -m trainfast doctor` (no trainfast in it) with a straggler: on rank 1
each batch takes DELAY seconds to load (the dataset sleeps once per batch), on rank 0 none, so rank 0 waits for rank 1
in DDP's all-reduce at every step.

usage: ddp_straggler.py [--delay S]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BATCH = 8


class Batches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Whole batches (the loader's batch_size=None), each `delay_s` late."""

    def __init__(self, batches: int, delay_s: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches, BATCH, 16, generator=generator)
        self.y = torch.randn(batches, BATCH, 1, generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.06, help="seconds per batch on rank 1")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Batches(256, args.delay if rank == 1 else 0.0)
    loader = DataLoader(data, batch_size=None, sampler=DistributedSampler(data, seed=0))
    for epoch in range(1000):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
