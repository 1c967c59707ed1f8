"""The loader under both worker start methods: `make_loader(workers=2)` with 'fork' and with 'spawn' yields
exactly the batches of `workers=0` (every batch seeded by itself), over `ImageFolder` and over a plain map-style
dataset (`helpers.Draws`, importable by name as 'spawn' workers need)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from helpers import GLOBAL_RNGS, Draws, assert_same
from trainfast.data.images import ImageFolder
from trainfast.loader import Loader, make_loader

pytestmark = pytest.mark.timeout(60)  # every test here has a hard limit; worker tests set their own


def batches(dataset: Dataset[Any], workers: int, context: str | None) -> list[Any]:
    loader = make_loader(dataset, 8, workers=workers, device="cpu", seed=11, multiprocessing_context=context)
    assert isinstance(loader, Loader) and loader.plan.num_workers == workers
    try:
        return [list(loader), list(loader)]  # two epochs: persistent workers carry on into the second
    finally:
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.slow
def test_plain_dataset_two_workers_match_the_main_process(context: str) -> None:
    want = batches(Draws(40, GLOBAL_RNGS, dtype=torch.float64), 0, None)
    got = batches(Draws(40, GLOBAL_RNGS, dtype=torch.float64), 2, context)
    assert_same(got, want)
    assert len(want[0]) == 5 and not torch.equal(want[0][0], want[1][0])  # a new order and new draws per epoch
    for col in (1, 2, 3):  # numpy, random, torch: no two samples of an epoch drew the same number
        values = torch.cat(got[0])[:, col].tolist()
        assert len(set(values)) == len(values), "two samples drew the same random number"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.slow
def test_image_folder_two_workers_match_the_main_process(context: str, tiny_images: Path) -> None:
    dataset = ImageFolder(tiny_images / "train", image_size=24, train=True)  # random crops and flips
    want = batches(dataset, 0, None)
    got = batches(dataset, 2, context)
    assert_same(got, want)
    assert want[0][0][0].shape == (8, 3, 24, 24) and want[0][0][0].dtype == torch.uint8
