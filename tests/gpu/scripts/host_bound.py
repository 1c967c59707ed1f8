"""Doctor script, host-bound: a tiny model whose batch is already on the GPU, and after every optimizer step
a bookkeeping loop of several hundred tiny kernels (a running average updated elementwise) ending in `.item()`.
Each tiny kernel takes the GPU microseconds but costs Python and a launch on the host: between the end of one
step and the next batch request the host is busy for milliseconds while the GPU idles."""

import argparse

import torch
import torch.nn.functional as F
from same_batch import SameBatch
from torch import nn
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", type=int, default=400, help="tiny bookkeeping updates per step")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x, y = torch.randn(64, 32, device=device), torch.randint(0, 4, (64,), device=device)
    loader = DataLoader(SameBatch((x, y), args.steps), batch_size=None, num_workers=0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    running = torch.zeros((), device=device)
    for inputs, targets in loader:
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        detached = loss.detach()
        for _ in range(args.kernels):  # per-step metrics, one tiny launch at a time
            running.mul_(0.999).add_(detached, alpha=0.001)
        running.item()  # logged every step: a host sync


if __name__ == "__main__":
    main()
