"""FSDP vs DDP at 2 ranks: what each rank holds, and what an FSDP checkpoint costs training.

    torchrun --standalone --nproc-per-node=2 benchmarks/fsdp_memory.py --width 1024 --depth 8 --epochs 5

One Trainer per strategy on the same residual MLP (DDP first, then FSDP), each for `--epochs` epochs with a checkpoint
at each epoch's end. Printed by rank 0:

- per rank, the bytes of the parameters and of the optimizer's state it holds (the local shards of sharded tensors:
  `sharding.local_bytes`) under each strategy, and their ratio (FSDP/DDP; 1/world_size is the ideal);
- per FSDP save, the time training waited for it (`FitResult.checkpoint_blocked_s`: the Trainer's blocking part,
  the previous write's join included) against a plain copy of the same state to host memory (`to_host` of the same
  model and optimizer state dicts, timed on the same rank right before the save, in `on_validation_end`, between two
  barriers so that no rank's save starts waiting for a late one), and their ratio;
  the medians over the saves after the first (the first also starts DCP's writer), with the range;
- the background write's time (`checkpoint_write_s`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.trainer.checkpoint import to_host
from trainfast.trainer.distributed import barrier
from trainfast.trainer.sharded_checkpoint import dcp_state
from trainfast.trainer.sharding import local_bytes


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.act = nn.Linear(width, width), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class PlainCopy:
    """Right before each save (`on_validation_end`; the previous write long done): a plain copy of the same state to
    host memory, timed."""

    def __init__(self) -> None:
        self.copy_s: list[float] = []

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        barrier()  # the ranks aligned: the save's own collective (the RNG gather) then waits for no late rank
        started = time.perf_counter()
        to_host(dcp_state(trainer.model, trainer.optimizer))
        self.copy_s.append(time.perf_counter() - started)
        barrier()


def run(strategy: str, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(args.depth)), nn.Linear(args.width, 10))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.samples, args.width, generator=g), torch.randint(0, 10, (args.samples,), generator=g)
    copy = PlainCopy()
    trainer = Trainer(model, config=TrainConfig(epochs=args.epochs, checkpoint_dir=os.path.join(folder, strategy),
                                                device="cpu", precision="32-true", strategy=strategy, progress=False,
                                                log_every=1000), callbacks=[copy])
    val = make_loader((x[:64], y[:64]), args.batch_size, shuffle=False, workers=0)
    result = trainer.fit(make_loader((x, y), args.batch_size, seed=0, workers=0), val)
    params, state = local_bytes(trainer.model, trainer.optimizer)
    return {"params": params, "optimizer_state": state, "blocked_s": result.checkpoint_blocked_s,
            "write_s": result.checkpoint_write_s, "copy_s": copy.copy_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048, help="per epoch: long enough for a write to finish")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "trainfast-fsdp-memory"),
                        help="checkpoints, one folder per strategy (every rank's path: on one machine, /tmp is fine)")
    args = parser.parse_args()
    figures = {strategy: run(strategy, args, args.folder) for strategy in ("ddp", "fsdp")}
    if int(os.environ.get("RANK", "0")) != 0:
        return
    ddp, fsdp = figures["ddp"], figures["fsdp"]
    held = {name: f["params"] + f["optimizer_state"] for name, f in figures.items()}
    print(f"per rank: DDP {held['ddp'] / 2**20:.1f} MiB (parameters {ddp['params'] / 2**20:.1f} + optimizer "
          f"{ddp['optimizer_state'] / 2**20:.1f}), FSDP {held['fsdp'] / 2**20:.1f} MiB (parameters "
          f"{fsdp['params'] / 2**20:.1f} + optimizer {fsdp['optimizer_state'] / 2**20:.1f}): "
          f"{held['fsdp'] / held['ddp']:.3f}x")
    later = list(zip(fsdp["blocked_s"][1:], fsdp["copy_s"][1:], strict=True))
    ratios = [blocked / copied for blocked, copied in later]
    print("FSDP saves: training waited " + ", ".join(f"{b * 1e3:.1f}" for b in fsdp["blocked_s"]) + " ms; plain copy "
          "to host " + ", ".join(f"{c * 1e3:.1f}" for c in fsdp["copy_s"]) + " ms; waited/copy after the first: "
          f"median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}); background writes "
          + ", ".join(f"{w:.3f}" for w in fsdp["write_s"]) + " s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **figures}, f, indent=1)


if __name__ == "__main__":
    main()
