"""The Trainer on dict (Hugging Face style) batches: a batch_loss trains on them, samples/s counts samples (the
leading dimension of the first tensor), the device move keeps them dicts, and the default (inputs, targets)
path refuses a dict clearly instead of unpacking its keys."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainfast import TrainConfig, Trainer
from trainfast.trainer.clock import WARMUP_STEPS


class Features(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "labels": self.y[i]}


def config(**overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"epochs": 1, "progress": False, "warmup_steps": 1, "device": "cpu"}
    return TrainConfig(**(values | overrides))


def dict_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["features"]), batch["labels"])


def test_samples_per_s_counts_the_samples_of_dict_batches() -> None:
    trainer = Trainer(nn.Linear(8, 4), config=config(), batch_loss=dict_step)
    result = trainer.fit(DataLoader(Features(64), batch_size=16), DataLoader(Features(20), batch_size=8))
    assert trainer.clock.samples == [16, 16, 16, 16]  # samples per step, not 1 per dict
    summary = trainer.clock.summary()
    assert summary.samples == 16 * (4 - WARMUP_STEPS)
    assert result.samples_per_s == pytest.approx(summary.samples / summary.seconds)
    assert result.val_loss is not None  # validation weights each dict batch by its samples too


def test_dict_and_tuple_batches_count_alike() -> None:
    features = Features(48)
    tuple_trainer = Trainer(nn.Linear(8, 4), config=config())
    tuple_trainer.fit(DataLoader(TensorDataset(features.x, features.y), batch_size=12))
    dict_trainer = Trainer(nn.Linear(8, 4), config=config(), batch_loss=dict_step)
    dict_trainer.fit(DataLoader(features, batch_size=12))
    assert dict_trainer.clock.samples == tuple_trainer.clock.samples == [12] * 4


def test_nested_and_mapping_batches_are_moved_and_counted() -> None:
    """channels_last=True puts the DevicePrefetcher in the path on the CPU too: it moves every Mapping (here
    a UserDict, as Hugging Face's BatchEncoding is) to the device in its own type, as torch's collate keeps it."""
    seen: list[type] = []

    class Nested:
        def __len__(self) -> int:
            return 3

        def __iter__(self) -> Iterator[Any]:
            for _ in range(3):
                yield ("meta", UserDict({"inputs": {"features": torch.randn(5, 8)}, "labels": torch.zeros(5).long()}))

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        _, fields = batch
        seen.append(type(fields))
        return F.cross_entropy(model(fields["inputs"]["features"]), fields["labels"])

    trainer = Trainer(nn.Linear(8, 4), config=config(channels_last=True), batch_loss=step)
    trainer.fit(Nested())
    assert seen == [UserDict] * 3 and trainer.clock.samples == [5] * 3


def test_a_dict_batch_without_batch_loss_is_refused_not_unpacked() -> None:
    """`inputs, targets = {"features": ..., "labels": ...}` would bind the two keys; the error names them."""
    trainer = Trainer(nn.Linear(8, 4), config=config())
    with pytest.raises(TypeError, match=r"got dict with keys \['features', 'labels'\].*batch_loss"):
        trainer.fit(DataLoader(Features(32), batch_size=8))


def test_the_old_step_fn_name_still_works_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="step_fn is now batch_loss"):
        trainer = Trainer(nn.Linear(8, 4), config=config(), step_fn=dict_step)
    assert trainer.batch_loss is dict_step
    with pytest.raises(TypeError, match="pass batch_loss only"):
        Trainer(nn.Linear(8, 4), config=config(), step_fn=dict_step, batch_loss=dict_step)
