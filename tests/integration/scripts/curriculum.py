"""A curriculum in the dataset: the loop lowers `ds.noise` (the noise added to each target) after every step, in the
main process, so the loss falls as training goes on only where the main process's dataset makes the batches. The
loader has no workers (`--workers 0`, the default): worker processes would hold a copy of the dataset made when they
start, its noise never lowered, and train on targets as noisy as the first step's.

Each sample costs ~3 ms of CPU (`--cost-ms`) in __getitem__, so the loop waits for its batches and the doctor offers
more workers. Unseeded: each run draws its own data, noise and initial weights. `--fixed` keeps the noise as it
starts (the dataset is never touched): runs then differ only by their draws."""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __init__(self, n, dim, cost_s, noise):
        self.x = torch.randn(n, dim)
        self.y = self.x @ torch.randn(dim, 1) / dim ** 0.5 / 4
        self.cost_s, self.noise = cost_s, noise

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        started = time.thread_time()
        while time.thread_time() - started < self.cost_s:  # CPU work, as a decode or an augmentation is
            pass
        return self.x[i], self.y[i] + self.noise * torch.randn(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--cost-ms", type=float, default=3.0)
    parser.add_argument("--noise", type=float, default=2.0, help="the targets' noise at the start")
    parser.add_argument("--decay", type=float, default=0.6, help="the noise's factor after each step")
    parser.add_argument("--fixed", action="store_true", help="never change the dataset's noise")
    args = parser.parse_args()
    ds = Noisy(1024, 8, args.cost_ms / 1e3, args.noise)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=args.workers)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    while step < args.steps:
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if not args.fixed:
                ds.noise = max(0.01, ds.noise * args.decay)
            if step >= args.steps:
                break
    print(f"trained {step} steps; last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
