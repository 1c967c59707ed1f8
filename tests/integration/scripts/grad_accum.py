"""Gradient accumulation: a DataLoader over in-memory tensors, an MLP, `loss / accum` backward on every
micro-batch and one optimizer.step() per --accum micro-batches.

Prints its own throughput every --log-steps optimizer steps (samples = micro-batch size x accum per step):
    step 10 samples/s 1234.5 loss 2.3026
"""

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--features", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch size")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--log-steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, args.features, generator=g)
    y = torch.randint(0, args.classes, (args.samples,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        drop_last=True)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, args.classes))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step, running, window_samples, window_start = 0, 0.0, 0, time.time()
    optimizer.zero_grad()
    for _epoch in range(args.epochs):
        for i, (inputs, targets) in enumerate(loader):
            loss = criterion(model(inputs), targets) / args.accum
            loss.backward()
            running += loss.item()
            window_samples += inputs.size(0)
            if (i + 1) % args.accum == 0:
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step % args.log_steps == 0:
                    now = time.time()
                    rate = window_samples / (now - window_start)
                    print(f"step {step} samples/s {rate:.1f} loss {running / args.log_steps:.4f}", flush=True)
                    running, window_samples, window_start = 0.0, 0, now


if __name__ == "__main__":
    main()
