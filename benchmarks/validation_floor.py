"""The floor of the Trainer's validation on the quick demo: the forward pass alone, as `validate` runs it.

The reference convnet (64 px, 10 classes) in eval mode, channels_last, bf16 autocast on the CPU, one intra-op thread
(what `trainfast train` picks on 2 CPUs beside one loader worker), over 7 batches of 64 random images (448; the quick
demo's validation set is 400), under no_grad (the Trainer's) and under inference_mode; one warm-up pass, then the
best and the median of `--repeats` passes. No data loading: what a pass costs when its batches are ready.

    python benchmarks/validation_floor.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainfast.bench.hardware import describe, hardware
from trainfast.data import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model("convnet", num_classes=10, image_size=64).eval().to(memory_format=torch.channels_last)
    images = torch.randn(64, 3, 64, 64).contiguous(memory_format=torch.channels_last)

    def one_pass(mode: str) -> float:
        grad_off = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
        with grad_off, torch.autocast("cpu", dtype=torch.bfloat16):
            started = time.perf_counter()
            for _ in range(7):
                model(images)
            return time.perf_counter() - started

    print(describe(hardware()))
    for mode in ("no_grad", "inference_mode"):
        one_pass(mode)
        times = [one_pass(mode) for _ in range(opts.repeats)]
        print(f"{mode}: a pass of 448 images in {min(times):.3f} s at best, {statistics.median(times):.3f} s median "
              f"({448 / min(times):,.0f} images/s)")


if __name__ == "__main__":
    main()
