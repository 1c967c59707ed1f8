"""A plain FSDP2 loop (`torch.distributed.fsdp.fully_shard`) on gloo, on the CPU, for `torchrun ... -m trainfast
doctor` (no trainfast in it): each block and the root are sharded, so every step all-gathers the parameters in
forward and backward and reduce-scatters the gradients.

usage: fsdp2_doctor_loop.py [--steps N]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x, y = torch.randn(32, 64, generator=generator), torch.randn(32, 1, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
