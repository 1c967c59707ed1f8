"""A diffusion trainer's loop in miniature: a DataLoader of 2 workers that do not persist, re-iterated every few
steps through a `cycle` generator (`while True: for x in dl: yield x`), and a small conv net whose step is long
enough that each epoch's worker restart shows (the last epoch's shutdown, the fork, the new workers' queues filling
beside the step). --start-ms makes each worker's start wait that long before its first sample (a dataset opening
its files or its connection in each worker): a restart's cost that needs no core, so it shows on a busy machine."""

import argparse
import functools
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Noisy(Dataset):
    def __init__(self, n, size, work):
        self.n, self.size, self.work = n, size, work

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.rand(3, self.size, self.size, generator=torch.Generator().manual_seed(i))
        for _ in range(self.work):  # an augmentation's worth of work per sample
            x = nn.functional.avg_pool2d(x[None], 3, 1, 1)[0]
        return x


def slow_start(seconds, worker_id):
    time.sleep(seconds)


def cycle(dl):
    while True:  # the trainer wrote it so
        for x in dl:  # noqa: UP028
            yield x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--per-epoch", type=int, default=6, help="batches per epoch")
    parser.add_argument("--work", type=int, default=30, help="pooling passes per sample in the workers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--persistent-workers", action="store_true")
    parser.add_argument("--start-ms", type=float, default=0.0, help="each worker's start-up wait before it loads")
    args = parser.parse_args()
    batch = 8
    loader = DataLoader(Noisy(args.per_epoch * batch, 32, args.work), batch_size=batch, shuffle=True,
                        num_workers=args.workers, persistent_workers=args.persistent_workers, drop_last=True,
                        worker_init_fn=functools.partial(slow_start, args.start_ms / 1e3) if args.start_ms else None)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 64, 3, padding=1), nn.SiLU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 3, 3, padding=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = cycle(loader)
    for _ in range(args.steps):
        x = next(data)
        noise = torch.randn_like(x)
        loss = nn.functional.mse_loss(model(x + noise), noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
