"""An input-bound loop as many are written: a dataset whose every read waits on slow storage (`--read-ms`), a plain
`DataLoader(...)` call with its keywords written out, a small model. It times its own training, outside anything
trainfast measures, and prints it last:

    trained 512 samples in 3.21 s: 159.5 samples/s
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowReads(Dataset):
    def __init__(self, size: int, read_ms: float) -> None:
        self.size, self.read_s = size, read_ms / 1e3

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.read_s)  # the read's wait on storage: no CPU
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 16, 16, generator=g), i % 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--read-ms", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(SlowReads(args.samples, args.read_ms), batch_size=16, shuffle=True)
    seen, started = 0, time.perf_counter()
    for _ in range(args.epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(x)
    elapsed = time.perf_counter() - started
    print(f"trained {seen} samples in {elapsed:.2f} s: {seen / elapsed:.1f} samples/s", flush=True)


if __name__ == "__main__":
    main()
