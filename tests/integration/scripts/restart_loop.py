"""A DDP loop on gloo that resumes from its checkpoint, for `torchrun --max-restarts 1 -m trainfast doctor
--whole-run` (no trainfast in it): rank 0 saves OUT/ckpt.pt every `--every` steps; on the first attempt rank 1
raises at step `--fail-at`, and torchrun's agent starts both ranks again, which resume from the checkpoint and
train to `--steps`. Each rank writes the step it resumed from to OUT/attempt{n}_rank{r}.json.

usage: restart_loop.py OUT [--steps N] [--every N] [--fail-at N]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--fail-at", type=int, default=25)
    args = parser.parse_args()
    env = os.environ
    attempt, rank, world = int(env["TORCHELASTIC_RESTART_COUNT"]), int(env["RANK"]), int(env["WORLD_SIZE"])
    # torchrun's agent store outlives the attempts and the env:// rendezvous puts no attempt in its keys: a
    # restarted gloo group would read the first attempt's addresses (connection refused). Keys of its own per attempt:
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"restart_loop/attempt_{attempt}", store), rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoint = args.out / "ckpt.pt"
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    (args.out / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps({"resumed_at": step}))
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    while step < args.steps:
        if attempt == 0 and rank == 1 and step == args.fail_at:
            raise RuntimeError(f"rank 1 fails at step {step}")
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and step % args.every == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       checkpoint)
        dist.barrier()  # the checkpoint is on disk before any rank steps past it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
