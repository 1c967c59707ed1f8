"""Doctor script, compute-bound: large fp32 matrix multiplies (two 8192 x 8192 layers on a batch of 8192 rows,
~6.6 TFLOP per training step, of the order of 100 ms on a current GPU) on a batch already on the GPU. The
loss is read once per step (`.item()` after the backward pass, inside the step), so the host waits for the GPU
there instead of racing ahead: fetching, copying and the host's own work are tiny beside it.

`--dim` and `--batch` scale the work (smaller for a dry run on the CPU)."""

import argparse

import torch
import torch.nn.functional as F
from same_batch import SameBatch
from torch import nn
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.dim, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    loader = DataLoader(SameBatch((x, y), args.steps), batch_size=None, num_workers=0)
    model = nn.Sequential(nn.Linear(args.dim, args.dim, bias=False), nn.ReLU(),
                          nn.Linear(args.dim, args.dim, bias=False), nn.ReLU(), nn.Linear(args.dim, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    for inputs, targets in loader:
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        if not loss.item() < float("inf"):  # read inside the step: the wait for the GPU is the step's compute
            raise RuntimeError("the loss diverged")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
