"""Trainer under torchrun with strategy ddp/fsdp/auto (or alone) on a tiny MLP: each step's loss to a JSON file, a
SIGTERM at a step (rank 0 only: the ranks must agree), or a crash while a checkpoint is being written."""

import argparse
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all

WATCHDOG_S = 150  # no run of this script takes a third of that


class Record:
    """Each optimizer step's loss (the job's: the mean over ranks), and the stop or crash asked for."""

    def __init__(self, stop_at: int, crash_in_write: int, crash_at: int) -> None:
        self.losses: dict[int, float] = {}
        self.stop_at, self.crash_in_write, self.crash_at = stop_at, crash_in_write, crash_at

    def on_log(self, trainer, metrics):
        self.losses[metrics["step"]] = metrics["loss"]
        if metrics["step"] == self.crash_at:
            os._exit(3)  # every rank: a job killed mid-epoch
        if metrics["step"] == self.stop_at and int(os.environ.get("RANK", 0)) == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_end(self, trainer, epoch, metrics):
        if epoch + 1 == self.crash_in_write:
            # this epoch's checkpoint is being written in the background: every rank dies before they agree it is
            # done (a job killed mid-write)
            os._exit(3)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.act = nn.Linear(width, width), nn.GELU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def main():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--crash-in-write", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(400, 16, generator=g), torch.randint(0, 4, (400,), generator=g)
    seed_all(0)
    model = nn.Sequential(nn.Linear(16, 32), *(Block(32) for _ in range(3)), nn.Linear(32, 4))
    config = TrainConfig(epochs=args.epochs, log_every=1, checkpoint_dir=args.ckpt, device="cpu", progress=False,
                         warmup_steps=5, precision="32-true", strategy=args.strategy, lr=3e-3)
    record = Record(args.stop_at, args.crash_in_write, args.crash_at)
    loader = make_loader((x, y), args.batch_size, seed=1, workers=0)
    result = Trainer(model, config=config, callbacks=[record]).fit(loader, resume=args.resume)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(args.out).write_text(json.dumps({"losses": record.losses, "steps": result.steps,
                                              "checkpoint": result.checkpoint,
                                              "blocked_s": result.checkpoint_blocked_s}))


if __name__ == "__main__":
    sys.exit(main())
