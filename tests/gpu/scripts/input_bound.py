"""Doctor script, input-bound: every sample costs 2 ms of "decoding" (a sleep) in the main process
(num_workers=0), while the step itself is a tiny model on the GPU. The step waits ~30 ms for each batch of 16
and computes for well under 1 ms: data wait is nearly all of it."""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowSamples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Precomputed samples handed out after `delay_s` each, like a slow decode."""

    def __init__(self, n: int, delay_s: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=generator)
        self.y = torch.randint(0, 4, (n,), generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--delay", type=float, default=0.002, help="seconds per sample")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    loader = DataLoader(SlowSamples(16 * args.batches, args.delay), batch_size=16, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
