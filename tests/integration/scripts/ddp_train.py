"""Trainer under torchrun, for the fault tests: optional SIGTERM or crash at a step, digest of the weights."""

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all


class Fault:
    def __init__(self, stop_at: int, crash_at: int, marker: Path | None) -> None:
        self.stop_at, self.crash_at, self.marker = stop_at, crash_at, marker

    def on_log(self, trainer, metrics):
        rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if self.marker is not None and metrics["step"] == 2 and rank == 0:
            self.marker.write_text("training")
        if metrics["step"] == self.stop_at and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 0 is signalled: the ranks must still agree
        if metrics["step"] == self.crash_at and rank == 1 and attempt == 0:
            raise RuntimeError("rank 1 lost its GPU (simulated)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    seed_all(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
    if args.slow:
        import time

        class Slow(nn.Module):
            def forward(self, t):
                time.sleep(args.slow)
                return t
        model = nn.Sequential(Slow(), model)
    config = TrainConfig(epochs=args.epochs, log_every=1, checkpoint_dir=args.ckpt, device="cpu", progress=False,
                         warmup_steps=2)
    fault = Fault(args.stop_at, args.crash_at, Path(args.marker) if args.marker else None)
    result = Trainer(model, config=config, callbacks=[fault]).fit(make_loader((x, y), 8, seed=1),
                                                                  resume=args.resume)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
    rank = int(os.environ["RANK"])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"digest": digest, "steps": result.steps}))


if __name__ == "__main__":
    sys.exit(main())
