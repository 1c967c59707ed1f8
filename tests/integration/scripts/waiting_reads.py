"""A plain training script whose Dataset waits on storage: every `__getitem__` sleeps --latency-ms (the first-byte
latency of a network file system or an object store) before a little CPU work (a 3x32x32 image made and
normalised, plus --work-ms of busy computing: a decode's stand-in), fed by a DataLoader with --workers workers to a
small conv net on the CPU.

Prints its own throughput at the end: `samples/s 123.4` over the steps after the first epoch's first batch.
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowReads(Dataset):
    def __init__(self, n, latency_s, work_s):
        self.n, self.latency_s, self.work_s = n, latency_s, work_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.latency_s)  # the read waits: no CPU used
        until = time.thread_time() + self.work_s
        while time.thread_time() < until:  # the decode works: CPU only
            pass
        g = torch.Generator().manual_seed(i)
        image = torch.rand(3, 32, 32, generator=g)
        return (image - 0.5) / 0.25, i % 10


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--work-ms", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads-loader", action="store_true", help="trainfast.make_loader's threads, --workers of them")
    args = p.parse_args()
    torch.manual_seed(0)
    dataset = SlowReads(args.samples, args.latency_ms / 1e3, args.work_ms / 1e3)
    if args.threads_loader:
        import trainfast

        data = trainfast.make_loader(dataset, args.batch_size, workers=args.workers, backend="threads")
    else:
        data = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, drop_last=True)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen, start = 0, None
    for _ in range(args.epochs):
        for x, y in data:
            if start is None:
                start = time.perf_counter()
            else:
                seen += len(x)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    print(f"samples/s {seen / (time.perf_counter() - start):.1f}")


if __name__ == "__main__":
    main()
