"""Doctor script, transfer-bound: each step copies a 64 MiB float32 batch from host memory to the GPU and runs
a tiny linear model on it. From pageable memory (the default) `.to("cuda")` blocks the host for the whole copy
(milliseconds) while the model takes well under a millisecond: the copy is most of the step.

`--pin`: the batch lives in page-locked memory and is copied with `non_blocking=True`, so `.to()` only queues
the copy and returns at once; the host time in copies falls to almost nothing (the copy itself then runs on the
GPU, where the `.item()` below waits for it).
"""

import argparse

import torch
import torch.nn.functional as F
from same_batch import SameBatch
from torch import nn
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pin", action="store_true", help="page-locked batch, non_blocking copies")
    parser.add_argument("--rows", type=int, default=16384, help="rows of 1024 float32 (16384: 64 MiB)")
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x, y = torch.randn(args.rows, 1024), torch.randint(0, 10, (args.rows,))
    if args.pin and device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    loader = DataLoader(SameBatch((x, y), args.steps), batch_size=None, num_workers=0)
    model = nn.Linear(1024, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, targets in loader:
        inputs = inputs.to(device, non_blocking=args.pin)
        targets = targets.to(device, non_blocking=args.pin)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        if not loss.item() < float("inf"):  # a per-step check that reads the loss: one sync per step
            raise RuntimeError("the loss diverged")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
