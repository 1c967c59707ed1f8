"""Resume on CUDA: a run stopped by SIGTERM mid-epoch saves at the stop point, exits 143, and its resumed run
ends with exactly the weights of an uninterrupted run; RNG states survive a CUDA checkpoint.

The exact runs are subprocesses (tests/gpu/scripts/train_cuda.py): deterministic algorithms and the cuBLAS
workspace setting are process-wide and must be in place before CUDA starts.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.loader.seeding import seed_all
from trainfast.trainer import atomic_save, load_checkpoint
from trainfast.trainer.checkpoint import rng_state, set_rng_state

Python = Callable[..., "subprocess.CompletedProcess[str]"]
EXACT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # deterministic cuBLAS: read when CUDA starts
RUN_TIMEOUT_S = 60  # each run takes seconds
EPOCHS, PER_EPOCH = 3, 8  # train_cuda.py: 64 samples in batches of 8
STOP_AT = 11  # mid second epoch: epoch index 1, batch 3


def train(python: Python, scripts: Path, ckpt: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return python([str(scripts / "train_cuda.py"), "--ckpt", str(ckpt), "--out", str(out), *args],
                  timeout=RUN_TIMEOUT_S, **EXACT_ENV)


def result_of(done: subprocess.CompletedProcess[str], out: Path) -> dict[str, Any]:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def runs(python: Python, scripts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run, the run stopped by SIGTERM at STOP_AT, and its resumed run (three processes)."""
    root = tmp_path_factory.mktemp("resume")
    reference = result_of(train(python, scripts, root / "reference", root / "reference.json"),
                          root / "reference.json")
    stopped = train(python, scripts, root / "ckpt", root / "stopped.json", "--stop-at", str(STOP_AT))
    saved = None
    if (root / "ckpt" / "last.pt").exists():
        saved = torch.load(root / "ckpt" / "last.pt", map_location="cpu", weights_only=True)
    resumed = train(python, scripts, root / "ckpt", root / "resumed.json", "--resume")
    return {"reference": reference, "stopped": stopped, "saved": saved, "resumed": resumed,
            "resumed_out": root / "resumed.json"}


@pytest.mark.gpu
def test_sigterm_saves_at_the_stop_point_exits_143_and_the_resume_finishes(runs: dict[str, Any]) -> None:
    stopped: subprocess.CompletedProcess[str] = runs["stopped"]
    assert stopped.returncode == 143, f"exit {stopped.returncode}\n{stopped.stderr[-4000:]}"
    assert "SIGTERM received" in stopped.stderr
    assert f"stopped at epoch 2 batch 3 (step {STOP_AT})" in stopped.stderr, stopped.stderr[-3000:]
    saved = runs["saved"]
    assert saved is not None, "no last.pt after the stop"
    assert (saved["step"], saved["epoch"], saved["batch"]) == (STOP_AT, 1, 3)
    assert saved["rng"]["cuda"], "the checkpoint holds no CUDA RNG state"
    resumed = result_of(runs["resumed"], runs["resumed_out"])
    assert "resumed from" in runs["resumed"].stderr
    assert (resumed["steps"], resumed["epochs"]) == (EPOCHS * PER_EPOCH, EPOCHS)
    assert resumed["steps_run"] == EPOCHS * PER_EPOCH - STOP_AT  # it continued; it did not start over
    assert resumed["device"].startswith("cuda")


@pytest.mark.gpu
def test_resume_mid_epoch_is_bit_exact_on_cuda(runs: dict[str, Any]) -> None:
    reference = runs["reference"]
    assert reference["device"].startswith("cuda") and reference["steps"] == EPOCHS * PER_EPOCH
    resumed = result_of(runs["resumed"], runs["resumed_out"])
    assert resumed["steps_run"] == EPOCHS * PER_EPOCH - STOP_AT, "the resumed run did not start at the stop point"
    assert resumed["digest"] == reference["digest"], "resumed weights differ from the uninterrupted run's"


def draws() -> list[object]:
    """One draw from each generator a training step may use: torch CPU, CUDA, numpy, Python."""
    return [torch.rand(4).tolist(), torch.rand(4, device="cuda").tolist(), np.random.rand(4).tolist(),
            random.random()]


@pytest.mark.gpu
@pytest.mark.parametrize("map_location", ["cpu", "cuda"])
def test_rng_states_restore_from_a_checkpoint_saved_on_cuda(tmp_path: Path, map_location: str) -> None:
    seed_all(5)
    torch.cuda.manual_seed_all(7)
    torch.rand(3, device="cuda")  # move the CUDA generator's offset away from its seed
    path = atomic_save({"model": nn.Linear(2, 2).cuda().state_dict(), "rng": rng_state()}, tmp_path / "rng.pt")
    first = draws()
    state = load_checkpoint(path, map_location=map_location)
    set_rng_state(state["rng"])
    assert draws() == first
    # torch's own setters take the saved states once they are CPU ByteTensors, wherever the file put them
    torch.set_rng_state(state["rng"]["torch"].cpu())
    torch.cuda.set_rng_state(state["rng"]["cuda"][0].cpu())
    assert torch.rand(4).tolist() == first[0] and torch.rand(4, device="cuda").tolist() == first[1]


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


@pytest.mark.gpu
def test_trainer_resumes_on_cuda_in_process(tmp_path: Path) -> None:
    """A checkpoint written by a CUDA run resumes in this process without errors (RNG states, optimizer state
    on the device) and training continues from where it stopped."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)

    def trainer(epochs: int) -> Trainer:
        seed_all(0)
        return Trainer(Dropper(), config=TrainConfig(epochs=epochs, device="cuda", progress=False, warmup_steps=2,
                                                     checkpoint_dir=str(tmp_path), seed=0))

    first = trainer(1)
    assert first.fit(make_loader((x, y), 16, seed=1)).steps == 4
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 4 and saved["rng"]["cuda"]
    second = trainer(2)
    result = second.fit(make_loader((x, y), 16, seed=1), resume=True)
    assert (result.steps, result.epochs) == (8, 2)
    assert result.final_loss is not None and np.isfinite(result.final_loss)
    assert all(p.device.type == "cuda" for p in second.model.parameters())
    for group in second.optimizer.state.values():
        for value in group.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device.type == "cuda", "optimizer state restored off the device"
    loss = F.cross_entropy(second.model(x.cuda()), y.cuda())
    assert torch.isfinite(loss)
