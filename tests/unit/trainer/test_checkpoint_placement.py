"""Where a resumed checkpoint is loaded: always on the CPU (the model and optimizer copy into their parameters'
device; RNG states must be CPU ByteTensors), so a CUDA run resumes. CUDA is faked: this machine has none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from helpers import blobs
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.trainer.checkpoint import CheckpointError, load_checkpoint, rng_state, set_rng_state


def config(ckpt: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"epochs": 1, "checkpoint_dir": str(ckpt), "progress": False, "device": "cpu"}
    return TrainConfig(**(values | overrides))


def test_resume_on_a_cuda_trainer_loads_the_checkpoint_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 saved_rngs: None) -> None:
    x, y = blobs()
    torch.manual_seed(0)
    Trainer(nn.Linear(8, 4), config=config(tmp_path)).fit(make_loader((x, y), 16))
    saved = torch.load(tmp_path / "last.pt", weights_only=True)

    trainer = Trainer(nn.Linear(8, 4), config=config(tmp_path))
    trainer.device = torch.device("cuda")  # as a CUDA run would have it; nothing else here touches the device
    placements: list[Any] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        placements.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    torch.manual_seed(123)  # moved away from the saved stream: resuming must bring it back
    trainer.fit(make_loader((x, y), 16), resume=True)  # the checkpoint's epoch is the last: resume only
    assert placements and all(torch.device(p) == torch.device("cpu") for p in placements), placements
    assert trainer.epoch == saved["epoch"] == 1 and trainer.step == saved["step"]
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])
    assert torch.equal(trainer.model.weight, saved["model"]["weight"])


def test_set_rng_state_takes_states_in_another_dtype_and_hands_cuda_cpu_byte_tensors(
        monkeypatch: pytest.MonkeyPatch, saved_rngs: None) -> None:
    """What a checkpoint loaded elsewhere may hold: RNG states as int64 (or on a GPU); torch and CUDA want CPU
    ByteTensors, numpy its uint32 keys."""
    torch.manual_seed(5)
    np.random.seed(6)
    state = rng_state()
    expected = (torch.rand(4), np.random.standard_normal(3))
    cuda_state = torch.arange(16, dtype=torch.uint8)
    state["torch"] = state["torch"].to(torch.int64)
    state["cuda"] = [cuda_state.to(torch.int64)]
    state["numpy"]["keys"] = state["numpy"]["keys"].to(torch.int64)
    state["cuda_device"] = 0
    handed: list[tuple[torch.Tensor, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda new, device: handed.append((new, device)))
    torch.manual_seed(99)
    np.random.seed(99)
    set_rng_state(state, torch.device("cuda", 0))
    monkeypatch.undo()
    assert torch.equal(torch.rand(4), expected[0])
    assert np.array_equal(np.random.standard_normal(3), expected[1])
    assert len(handed) == 1 and handed[0][1] == torch.device("cuda", 0)
    cuda = handed[0][0]
    assert cuda.dtype == torch.uint8 and cuda.device.type == "cpu" and torch.equal(cuda, cuda_state)


def test_a_load_error_that_is_not_about_pickles_does_not_advise_trusting_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """trusted=True runs the file's pickled code: advice only for what weights_only refused, never for an error
    that trusting would not mend (as torch's, for a checkpoint mapped to a device this machine lacks)."""
    x, y = blobs()
    Trainer(nn.Linear(8, 4), config=config(tmp_path)).fit(make_loader((x, y), 16))

    def load(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Attempting to deserialize object on a CUDA device")

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "last.pt")
    assert str(info.value) == (f"checkpoint {str(tmp_path / 'last.pt')!r} cannot be loaded: Attempting to "
                               "deserialize object on a CUDA device")
