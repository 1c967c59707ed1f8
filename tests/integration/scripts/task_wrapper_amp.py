"""The shape of timm's train.py: the model inside a task wrapper that owns the loss (whose `.to()` refuses a memory
format), a conv net with depthwise kernels, bf16 autocast (`--amp`), gradient accumulation, optionally
`--channels-last` (the model and its input in NHWC); `--no-compiler` gives inductor a C++ compiler that is not
there, as on a machine without one: a torch.compile of its model fails.

Prints its own throughput every --log-steps optimizer steps:
    step 10 samples/s 1234.5 loss 2.3026
"""

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.depthwise = nn.Conv2d(width, width, 3, padding=1, groups=width)  # strides fit both layouts
        self.mix = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.mix(F.relu(self.depthwise(F.relu(self.stem(x))))))
        return self.head(x.mean((2, 3)))


class Task(nn.Module):
    """The model and its loss in one module, called as task(input, target) -> {"loss", "output"}."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(x)
        return {"loss": F.cross_entropy(out, y), "output": out}

    def to(self, *args, **kwargs):  # a wrapper with its own idea of .to(): this one refuses a memory format
        if "memory_format" in kwargs:
            raise RuntimeError("required rank 4 tensor to use channels_last format")
        return super().to(*args, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--log-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-compiler", action="store_true")
    args = parser.parse_args()
    if args.no_compiler:
        import os

        from torch._inductor import config as inductor_config

        inductor_config.cpp.cxx = (None, "/nonexistent/g++")
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # a cached kernel would need no compiler
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size * 8, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (len(x),))
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = Net(args.width, 10)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    task = Task(model)
    optimizer = torch.optim.SGD(task.parameters(), lr=0.01, momentum=0.9)
    step, micro, window, started = 0, 0, 0, time.perf_counter()
    while step < args.steps:
        for inputs, targets in loader:
            if args.channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                loss = task(inputs, targets)["loss"]
            (loss / args.accum).backward()
            micro += 1
            window += len(inputs)
            if micro % args.accum:
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_steps == 0:
                now = time.perf_counter()
                print(f"step {step} samples/s {window / (now - started):.1f} loss {loss.item():.4f}", flush=True)
                window, started = 0, now
            if step >= args.steps:
                break


if __name__ == "__main__":
    main()
