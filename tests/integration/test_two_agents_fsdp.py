"""`trainfast train --strategy fsdp` as a job on two machines: one torchrun agent per "machine" (the `two_agents`
fixture: `--nnodes 2 --nproc-per-node 1`, a c10d rendezvous on localhost). Both agents end 0 and the sharded
checkpoint, every rank's shards and the Trainer's state, is in place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from trainfast.trainer.sharded_checkpoint import TEMP_DIR_PREFIX, load_trainer_state

if TYPE_CHECKING:  # the fixture's type; at run time `conftest` may name another folder's conftest
    from conftest import TwoAgents

LIMIT_S = 120  # start-up (two agents, a rendezvous, two interpreters importing torch) takes 5-10 s here
pytestmark = [pytest.mark.slow, pytest.mark.timeout(LIMIT_S + 30)]


def test_fsdp_train_ends_on_both_agents_with_a_sharded_checkpoint(tiny_images: Path, tmp_path: Path,
                                                                 two_agents: TwoAgents) -> None:
    result, ckpt = tmp_path / "result.json", tmp_path / "ckpt"
    runs = two_agents("-m", "trainfast", "train", "--strategy", "fsdp", "--data", str(tiny_images),
                      "--image-size", "16", "--batch-size", "8", "--epochs", "2", "--limit-batches", "4",
                      "--workers", "1", "--checkpoint-dir", str(ckpt), "--no-progress", "--json", str(result),
                      timeout=LIMIT_S)
    outputs = "\n".join(f"--- agent {i} (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-4000:]}"
                        for i, run in enumerate(runs))
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert sum("strategy: fsdp (strategy='fsdp'); fully_shard on" in run.stderr for run in runs) == 1, outputs
    assert json.loads(result.read_text())["checkpoint"] == str(ckpt / "last.dcp")
    assert load_trainer_state(ckpt / "last.dcp")["step"] == 8
    assert sorted(p.name for p in (ckpt / "last.dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(ckpt.glob(f"{TEMP_DIR_PREFIX}*"))
