"""A full disk under torchrun (2 ranks on gloo): rank 0's failed last.pt write reaches every rank, which all stop
with the same `CheckpointWriteError` at once: none waits at a barrier for a file that never comes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ENV = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent("""
    import errno, faulthandler, io, os, pathlib, sys, time
    import torch
    from torch import nn
    from trainfast import TrainConfig, Trainer, make_loader
    from trainfast.trainer import CheckpointWriteError
    from trainfast.trainer.distributed import dist_info

    faulthandler.dump_traceback_later(90, exit=True)  # a rank left waiting shows where, then exits
    rank = dist_info().rank
    if rank == 0:  # only rank 0 writes: its volume fills up after the first checkpoint
        real_save, calls = torch.save, [0]

        def save(obj, f, *args, **kwargs):
            calls[0] += isinstance(f, io.BufferedWriter)  # a file: not all_gather pickling tensors to memory
            if calls[0] < 2:
                return real_save(obj, f, *args, **kwargs)
            f.write(bytes(4096))
            raise OSError(errno.ENOSPC, "No space left on device")

        torch.save = save
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    torch.manual_seed(0)
    config = TrainConfig(epochs=3, checkpoint_dir=sys.argv[1], device="cpu", progress=False)
    out = pathlib.Path(sys.argv[2])
    try:
        Trainer(nn.Linear(8, 4), config=config).fit(make_loader((x, y), 8, seed=0))
    except CheckpointWriteError as e:
        (out / f"rank{rank}.txt").write_text(f"stopped: {e}")
        # torchrun stops the other ranks when one exits with an error: rank 0 waits until rank 1 has spoken
        deadline = time.monotonic() + 60
        while rank == 0 and not (out / "rank1.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(1)  # skips interpreter teardown, which is not under test here (and can stall a gloo rank)
    (out / f"rank{rank}.txt").write_text("finished")
""")


def test_rank_0_out_of_space_stops_every_rank_with_its_message(tmp_path: Path) -> None:
    script = tmp_path / "disk_full.py"
    script.write_text(SCRIPT)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(ckpt), str(out)], env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    said = {p.name: p.read_text() for p in out.iterdir()}
    assert sorted(said) == ["rank0.txt", "rank1.txt"], done.stderr[-3000:]
    assert said["rank0.txt"] == said["rank1.txt"]  # rank 1 learnt rank 0's own message
    message = said["rank0.txt"]
    assert message.startswith(f"stopped: could not write checkpoint {str(ckpt / 'last.pt')!r}: No space left on "
                              "device"), message
    assert f"the last intact checkpoint is {str(ckpt / 'last.pt')!r}" in message
    assert "Timeout" not in done.stderr
    assert torch.load(ckpt / "last.pt", weights_only=True)["epoch"] == 1
