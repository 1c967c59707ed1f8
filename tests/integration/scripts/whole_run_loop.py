"""A whole training run in the shape people write it: a DataLoader with worker processes restarted every epoch,
bf16 autocast in the training step, an evaluation pass in fp32 (model.eval() + no_grad) every --eval-every steps,
a torch.save checkpoint every --save-every steps, a print at each log point. With --eval-fetch-with-grad, the
evaluation fetches its batches with gradients on and runs each forward under no_grad, as the HF Trainer's
evaluation loop does.

It times its own phases without trainfast (perf_counter around each evaluation and each save, the process's start
from the OS) and prints them last, as one JSON line: `truth {"wall_s": ..., "startup_s": ..., "evaluation_s": ...,
"checkpoint_s": ..., "epoch_start_s": ..., "samples": ...}` -- the ground truth a whole-run report is checked against.
"""

import argparse
import itertools
import json
import os
import tempfile
import time

import psutil
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--eval-batch-size", type=int, default=None, help="default: --batch-size")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--eval-fetch-with-grad", action="store_true",
                        help="fetch evaluation batches outside no_grad (the HF Trainer's evaluation loop)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--sleep-ms", type=float, default=float(os.environ.get("WHOLE_RUN_SLEEP_MS", "0")),
                        help="a sleep in every step: the same script made slower (default: $WHOLE_RUN_SLEEP_MS or 0)")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.samples, 64)
    y = (x[:, :8].sum(1) > 0).long()
    train = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    eval_batch = args.eval_batch_size or args.batch_size
    val_x = torch.randn(eval_batch * args.eval_batches, 64)
    val = DataLoader(TensorDataset(val_x, (val_x[:, :8].sum(1) > 0).long()), batch_size=eval_batch)
    model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = args.precision == "bf16"
    truth = {"evaluation_s": 0.0, "checkpoint_s": 0.0, "epoch_start_s": 0.0, "samples": 0}
    folder = tempfile.mkdtemp(prefix="whole_run_")
    step = 0
    truth["startup_s"] = time.time() - psutil.Process().create_time()  # the first training batch is asked for
    for epoch in range(args.epochs):
        started = time.perf_counter()
        batches = iter(train)
        first = next(batches)
        truth["epoch_start_s"] += time.perf_counter() - started
        for inputs, targets in itertools.chain([first], batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            truth["samples"] += len(inputs)
            step += 1
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1e3)
            if step % args.eval_every == 0:
                started = time.perf_counter()
                model.eval()
                if args.eval_fetch_with_grad:
                    correct = 0
                    for v, t in val:
                        with torch.no_grad():
                            correct += (model(v).argmax(1) == t).sum().item()
                else:
                    with torch.no_grad():
                        correct = sum((model(v).argmax(1) == t).sum().item() for v, t in val)
                model.train()
                truth["evaluation_s"] += time.perf_counter() - started
                print(f"epoch {epoch} step {step}: loss {loss.item():.3f} val acc {correct / len(val.dataset):.3f}")
            if step % args.save_every == 0:
                started = time.perf_counter()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                           os.path.join(folder, "last.pt"))
                truth["checkpoint_s"] += time.perf_counter() - started
    truth["wall_s"] = time.time() - psutil.Process().create_time()
    print("truth " + json.dumps(truth), flush=True)


if __name__ == "__main__":
    main()
