"""TensorBoard scalars: `trainfast.tensorboard.ScalarWriter` (tags given by the caller) and the Trainer's
`TrainConfig(tensorboard=DIR)`: train/* at each log point and val/* at each epoch's end, read back with TensorBoard's
own reader; the writer closed however fit ends; one clear error naming the extra when tensorboard is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from helpers import blobs
from trainfast import tensorboard
from trainfast.loader.make import make_loader
from trainfast.trainer import ConfigError, NonFiniteLossError, TrainConfig, Trainer
from trainfast.trainer.loop import Trainer as LoopTrainer

STEPS = 4  # per epoch: 64 blobs in batches of 16


def events(folder: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return accumulator


def steps(accumulator: EventAccumulator, tag: str) -> list[int]:
    return [event.step for event in accumulator.Scalars(tag)]


def config(tmp_path: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"epochs": 2, "progress": False, "device": "cpu", "precision": "32-true",
                              "channels_last": False, "log_every": 2, "tensorboard": str(tmp_path / "tb")}
    return TrainConfig(**(values | overrides))


class Logged:
    def __init__(self) -> None:
        self.metrics: list[dict[str, Any]] = []

    def on_log(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.metrics.append(dict(metrics))


def test_fit_logs_training_scalars_at_log_points_and_validation_at_epoch_ends(tmp_path: Path) -> None:
    x, y = blobs()
    torch.manual_seed(0)
    logged = Logged()
    trainer = Trainer(nn.Linear(8, 4), config=config(tmp_path), callbacks=[logged])
    result = trainer.fit(make_loader((x, y), 16, shuffle=False), make_loader((x, y), 64, shuffle=False))
    assert trainer.tensorboard is None  # closed with fit
    found = events(tmp_path / "tb")
    tags = set(found.Tags()["scalars"])
    train = {"train/loss", "train/lr", "train/samples_per_s", "train/data_wait_fraction"}
    assert train | {"train/epoch_loss", "val/loss", "val/accuracy"} <= tags
    assert ("train/mfu" in tags) == (result.mfu is not None)  # when the Trainer has an MFU figure
    assert "train/loss_scale" not in tags  # fp32: no loss scaling
    for tag in train:
        assert steps(found, tag) == [2, 4, 6, 8], tag  # log_every=2 optimizer steps
    assert steps(found, "val/accuracy") == steps(found, "train/epoch_loss") == [STEPS, 2 * STEPS]
    # the figures on_log gets, at the same steps
    assert [e.value for e in found.Scalars("train/loss")] == pytest.approx([m["loss"] for m in logged.metrics])
    assert [e.value for e in found.Scalars("train/lr")] == pytest.approx([m["lr"] for m in logged.metrics])
    assert found.Scalars("val/accuracy")[-1].value == pytest.approx(result.val_accuracy)


def test_the_writer_is_closed_when_fit_stops_with_an_error(tmp_path: Path) -> None:
    x, y = blobs()
    calls = [0]

    def poisoned(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = F.cross_entropy(out, target)
        return loss * float("nan") if calls[0] > 2 else loss

    trainer = Trainer(nn.Linear(8, 4), loss_fn=poisoned, config=config(tmp_path, log_every=1))
    with pytest.raises(NonFiniteLossError):
        trainer.fit(make_loader((x, y), 16, shuffle=False))
    assert trainer.tensorboard is None  # (and its writer thread stopped: the test would fail on a leaked thread)
    assert steps(events(tmp_path / "tb"), "train/loss") == [1, 2]  # what was logged before the stop is on disk


def test_without_tensorboard_the_trainer_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the tensorboard package, which is not installed: "
                                          r"pip install 'trainfast\[tensorboard\]'"):
        LoopTrainer(nn.Linear(8, 4), config=config(tmp_path))
    with pytest.raises(tensorboard.TensorBoardUnavailableError, match=r"trainfast\[tensorboard\]"):
        tensorboard.ScalarWriter(tmp_path)
    Trainer(nn.Linear(8, 4), config=config(tmp_path, tensorboard=None))  # not asked for: not needed


def test_the_scalar_writer_opens_on_the_first_write_and_takes_the_caller_s_tags(tmp_path: Path) -> None:
    with tensorboard.ScalarWriter(tmp_path / "doctor") as writer:
        writer.scalars(3, {"skipped": None})
        assert not (tmp_path / "doctor").exists()  # nothing written: no file
        writer.scalars(3, {"doctor/step_s": 0.25, "doctor/data_wait": 0.5}, wall_time=1000.0)
        writer.scalars(7, {"doctor/step_s": 0.125})
        writer.flush()
        assert steps(events(tmp_path / "doctor"), "doctor/step_s") == [3, 7]
    found = events(tmp_path / "doctor")
    assert set(found.Tags()["scalars"]) == {"doctor/step_s", "doctor/data_wait"}
    (event,) = found.Scalars("doctor/data_wait")
    assert (event.step, event.value, event.wall_time) == (3, 0.5, 1000.0)
    writer.close()  # closing twice is fine
