"""Batches in containers other than a plain tuple, list or dict come back from `DevicePrefetcher` (and the Trainer's
layout A/B) as the same type, rebuilt as torch's `default_collate` builds them: a namedtuple from its fields, a
mapping type through a copy."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers import Images, Sample
from trainfast.loader.prefetch import DevicePrefetcher, Normalize, move
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer


class Triple(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor
    weight: torch.Tensor




def test_default_collate_namedtuple_batches_pass_the_prefetcher_as_namedtuples() -> None:
    loader = DataLoader(Images(), batch_size=8)
    batches = list(DevicePrefetcher(loader, "cpu", normalize=Normalize(), channels_last=True))
    assert len(batches) == 8
    first = batches[0]
    assert type(first) is Sample
    assert first.image.dtype == torch.float32 and first.image.is_contiguous(memory_format=torch.channels_last)
    assert first.label.shape == (8,)


def test_move_rebuilds_namedtuples_and_keeps_mapping_types() -> None:
    t = torch.ones(2)
    moved = move(Triple(t, t, t), torch.device("cpu"))
    assert type(moved) is Triple and moved.weight is t
    ordered = move(OrderedDict(a=t, b=[Sample(t, t)]), torch.device("cpu"))
    assert type(ordered) is OrderedDict and list(ordered) == ["a", "b"] and type(ordered["b"][0]) is Sample


def test_the_default_trainer_trains_a_conv_net_on_namedtuple_batches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    loader = DataLoader(Images(dtype=torch.float32), batch_size=2)  # 32 steps: the layout A/B converts namedtuples too
    config = TrainConfig(epochs=1, progress=False, device="cpu", precision="32-true", channels_last="auto")
    result = Trainer(model, config=config).fit(loader)
    assert result.steps == 32 and result.channels_last is not None and result.channels_last["measured"] is True
