"""The loader under both worker start methods: `make_loader(workers=2)` with 'fork' and with 'spawn' yields
exactly the batches of `workers=0` (every batch seeded by itself), over `ImageFolder` and over a plain map-style
dataset. `Draws` lives at module level so that 'spawn' workers can import it by name."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from trainfast.data.images import ImageFolder
from trainfast.loader import Loader, make_loader

pytestmark = pytest.mark.timeout(60)  # every test here has a hard limit; worker tests set their own


class Draws(Dataset[torch.Tensor]):
    """Sample i: (i, a draw from each global RNG: numpy, random, torch), as an augmentation would make."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(np.random.random()), random.random(), float(torch.rand(()))],
                            dtype=torch.float64)


def batches(dataset: Dataset[Any], workers: int, context: str | None) -> list[Any]:
    loader = make_loader(dataset, 8, workers=workers, device="cpu", seed=11, multiprocessing_context=context)
    assert isinstance(loader, Loader) and loader.plan.num_workers == workers
    try:
        return [list(loader), list(loader)]  # two epochs: persistent workers carry on into the second
    finally:
        loader.close()


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    else:
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_plain_dataset_two_workers_match_the_main_process(context: str) -> None:
    want = batches(Draws(), 0, None)
    got = batches(Draws(), 2, context)
    assert_same(got, want)
    assert len(want[0]) == 5 and not torch.equal(want[0][0], want[1][0])  # a new order and new draws per epoch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_image_folder_two_workers_match_the_main_process(context: str, tiny_images: Path) -> None:
    dataset = ImageFolder(tiny_images / "train", image_size=24, train=True)  # random crops and flips
    want = batches(dataset, 0, None)
    got = batches(dataset, 2, context)
    assert_same(got, want)
    assert want[0][0][0].shape == (8, 3, 24, 24) and want[0][0][0].dtype == torch.uint8
