"""Trainer on CUDA for the GPU resume tests: a tiny model with dropout (drawn from the CUDA generator), trained
in fp32 with deterministic algorithms, optionally stopped by SIGTERM at an optimizer step; the final weights'
digest goes to --out as JSON.

Exactness needs, besides the Trainer's own care: `torch.use_deterministic_algorithms(True)` (set here),
CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (set by the test, before CUDA starts), precision
"32-true" (no TF32, no autocast), cudnn_benchmark off, and the same seeds in every process. The loss is a mean
squared error: its CUDA kernels have deterministic implementations (torch lists NLLLoss on CUDA among the
operations that refuse deterministic mode).
"""

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all

BATCH = 8
SAMPLES = 64  # 8 batches per epoch


class SigtermAt:
    """Sends this process SIGTERM when the Trainer logs the given optimizer step, as a scheduler would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if metrics["step"] == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class StepCounter:
    """Counts the optimizer steps this process took (log_every=1: one log per step)."""

    def __init__(self) -> None:
        self.steps = 0

    def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.steps += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True, help="checkpoint folder")
    parser.add_argument("--out", required=True, help="JSON file for the digest of the final weights")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stop-at", type=int, default=0, help="SIGTERM at this optimizer step (0: never)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--device", default="cuda", help="'cpu' for a dry run without a GPU")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=generator)
    y = torch.randn(SAMPLES, 4, generator=generator)
    seed_all(0)  # the same initial weights in every process (the resumed run then loads its checkpoint)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.2), nn.GELU(), nn.Linear(64, 4))
    config = TrainConfig(epochs=args.epochs, precision="32-true", device=args.device, seed=0, log_every=1,
                         progress=False, warmup_steps=2, cudnn_benchmark=False, checkpoint_dir=args.ckpt)
    counter = StepCounter()
    callbacks: list[object] = [counter, *([SigtermAt(args.stop_at)] if args.stop_at > 0 else [])]
    trainer = Trainer(model, loss_fn=F.mse_loss, config=config, callbacks=callbacks)
    result = trainer.fit(make_loader((x, y), BATCH, seed=1), resume=args.resume)  # SystemExit(143) on SIGTERM
    state = trainer.model.state_dict()
    digest = hashlib.sha256(b"".join(state[k].detach().cpu().numpy().tobytes() for k in sorted(state)))
    device = str(next(iter(state.values())).device)
    Path(args.out).write_text(json.dumps({"digest": digest.hexdigest(), "steps": result.steps, "epochs": result.epochs,
                                          "steps_run": counter.steps, "device": device}))


if __name__ == "__main__":
    main()
