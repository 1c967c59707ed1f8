"""Trainer under torchrun (or alone) for the fault tests: SIGTERM or a crash at a step, digest of the weights."""

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all

WATCHDOG_S = 120  # no run of this script takes a tenth of that


class Fault:
    def __init__(self, stop_at: int, crash_at: int) -> None:
        self.stop_at, self.crash_at = stop_at, crash_at

    def on_log(self, trainer, metrics):
        rank, attempt = int(os.environ.get("RANK", 0)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if metrics["step"] == self.stop_at and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 0 is signalled: the ranks must still agree
        if metrics["step"] == self.crash_at and rank == 1 and attempt == 0:
            raise RuntimeError("rank 1 lost its GPU (simulated)")


class Slow(nn.Module):
    """Sleeps in each forward (a slow step); writes `marker` at the third training forward (training is on and
    gradients too: the precision A/B's loss check forwards without them)."""

    def __init__(self, seconds: float, marker: Path | None) -> None:
        super().__init__()
        self.seconds, self.marker, self.calls = seconds, marker, 0

    def forward(self, t):
        time.sleep(self.seconds)
        self.calls += self.training and torch.is_grad_enabled()
        if self.marker is not None and self.calls == 3:
            self.marker.write_text("training")
        return t


def main():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hung rank shows where it hangs, then exits
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=1)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    seed_all(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
    if args.slow:
        model = nn.Sequential(Slow(args.slow, Path(args.marker) if args.marker else None), model)
    config = TrainConfig(epochs=args.epochs, log_every=args.log_every, checkpoint_dir=args.ckpt, device="cpu",
                         progress=False, warmup_steps=2)
    fault = Fault(args.stop_at, args.crash_at)
    loader = make_loader((x, y), 8, seed=1, workers=args.workers)
    result = Trainer(model, config=config, callbacks=[fault]).fit(loader, resume=args.resume)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
    rank = int(os.environ.get("RANK", 0))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"digest": digest, "steps": result.steps}))


if __name__ == "__main__":
    sys.exit(main())
