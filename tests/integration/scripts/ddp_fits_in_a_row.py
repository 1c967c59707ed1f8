"""Several `Trainer.fit` calls, one after the other, in each process of a torchrun job: weights digest per rank."""

import faulthandler
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all

WATCHDOG_S = 60  # all fits take about 10 s: longer means a rank hangs in a rendezvous
LAG_S = 1.5  # rank 0 starts each later fit this much later: rank 1 reaches the rendezvous first
# Whether a rank that read a stale peer address fails depends on which side of a gloo pair connects (the ports
# decide): about half the time per fit. Four fits give three chances to catch stale keys.
FITS = 4


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hung rank shows where it hangs, then exits
    out = Path(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"  # "cuda": NCCL, one GPU per rank
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    seed_all(0)
    model = nn.Linear(8, 4)
    rank = int(os.environ.get("RANK", 0))
    steps = []
    for fit in range(FITS):
        if fit > 0 and rank == 0:
            time.sleep(LAG_S)
        config = TrainConfig(epochs=1, device=device, progress=False, warmup_steps=1, compile=False)
        steps.append(Trainer(model, config=config).fit(make_loader((x, y), 8, seed=1, workers=0)).steps)
    digest = hashlib.sha256(b"".join(v.cpu().numpy().tobytes() for v in model.state_dict().values())).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"digest": digest, "steps": steps}))


if __name__ == "__main__":
    main()
