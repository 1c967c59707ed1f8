"""A 2-rank job with every "auto" on (precision, compile; channels_last is settled under DDP) where rank 1 is delayed
at random, in its data and in its step: the ranks time each A/B differently, and must still end every A/B at the
same step with the same choices. Writes each rank's choices and a digest of its weights to OUT/rank{R}.json."""

import argparse
import faulthandler
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainfast import TrainConfig, Trainer
from trainfast.precision import cpufeatures

WATCHDOG_S = 100  # each rank dumps its stacks and exits if it is still running then: a hang shows where it hangs


class Skewed(Dataset):
    """32x4 samples; on rank 1, a read sleeps now and then (a slow disk, a busy node)."""

    def __init__(self, delay: random.Random | None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(256, 3, 8, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        if self.delay is not None and self.delay.random() < 0.1:
            time.sleep(self.delay.uniform(0.0, 0.03))
        return self.x[i], self.y[i]


class Net(nn.Module):
    """A small conv net; on rank 1 its forward sleeps now and then (a slower or throttled device)."""

    def __init__(self, delay: random.Random | None) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4))
        self.delay = delay

    def forward(self, x):
        if self.delay is not None and self.training and self.delay.random() < 0.3:
            time.sleep(self.delay.uniform(0.0, 0.04))
        return self.body(x)


def main():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compile", default="auto")
    parser.add_argument("--device", default="cpu")  # "cuda": NCCL, one GPU per rank
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    delay = random.Random(args.seed) if rank == 1 else None
    cpufeatures.cpu_bf16 = lambda: "AVX512-BF16"  # the bf16 prior and its A/B on any CPU (emulated bf16 is slower)
    torch.manual_seed(0)
    dataset = Skewed(delay)
    sampler = DistributedSampler(dataset, num_replicas=int(os.environ.get("WORLD_SIZE", 1)), rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    compile_setting = {"auto": "auto", "true": True, "false": False}[args.compile]
    config = TrainConfig(epochs=1, device=args.device, progress=False, precision="auto", channels_last="auto",
                         compile=compile_setting, cpu_threads=1, warmup_steps=0)
    trainer = Trainer(Net(delay), config=config)
    result = trainer.fit(loader).to_json()
    digest = hashlib.sha256(b"".join(p.detach().float().cpu().numpy().tobytes() for p in trainer.model.parameters()))
    choices = {name: result[name]["chosen"] for name in ("precision", "channels_last", "compile")}
    measured = {name: result[name]["measured"] for name in ("precision", "channels_last", "compile")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"choices": choices, "measured": measured,
                                                      "steps": result["steps"], "weights": digest.hexdigest()}))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
