"""memory.py: `TensorLoader` and `make_loader`'s dispatch of in-memory tensors to it."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from trainfast.loader import Loader, TensorLoader, make_loader
from trainfast.loader.batches import EpochBatches


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(n * 6, dtype=torch.float32).view(n, 2, 3)
    y = torch.arange(n) * 10
    return x, y


def expected_order(n: int, batch_size: int, *, epoch: int, **kwargs: Any) -> list[torch.Tensor]:
    s = EpochBatches(n, batch_size, **kwargs)
    s.set_epoch(epoch)
    return [torch.from_numpy(idx.copy()) for _, idx in s]


@pytest.mark.parametrize("wrap", ["TensorDataset", "tuple", "list"])
def test_in_memory_tensors_take_the_tensor_loader(wrap: str) -> None:
    x, y = data()
    dataset: Any = {"TensorDataset": TensorDataset(x, y), "tuple": (x, y), "list": [x, y]}[wrap]
    loader = make_loader(dataset, 4, seed=5, device="cpu")
    assert isinstance(loader, TensorLoader)
    assert loader.plan is not None
    assert loader.plan.num_workers == 0 and loader.plan.in_memory and loader.plan.drop_last
    for epoch in range(2):
        order = expected_order(10, 4, epoch=epoch, shuffle=True, drop_last=True, seed=5)
        got = list(loader)
        assert len(got) == len(order) == len(loader) == 2
        for (bx, by), idx in zip(got, order, strict=True):
            assert torch.equal(bx, x[idx]) and torch.equal(by, y[idx])


def test_in_memory_with_explicit_workers_uses_a_dataloader() -> None:
    x, y = data()
    loader = make_loader((x, y), 4, workers=1, device="cpu", persistent_workers=False, seed=2)
    assert isinstance(loader, Loader) and loader.plan.num_workers == 1
    reference = make_loader((x, y), 4, workers=0, device="cpu", seed=2)
    for (ax, ay), (bx, by) in zip(loader, reference, strict=True):
        assert torch.equal(ax, bx) and torch.equal(ay, by)


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2), (2, 3)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_follow_epoch_batches(rank: int, world: int, shuffle: bool) -> None:
    x, y = data(11)
    loader = TensorLoader((x, y), 3, shuffle=shuffle, drop_last=False, seed=8, rank=rank, world_size=world)
    loader.set_epoch(4)
    order = expected_order(11, 3, epoch=4, shuffle=shuffle, drop_last=False, seed=8, rank=rank, world_size=world)
    got = list(loader)
    assert len(got) == len(order) == len(loader)
    for (bx, by), idx in zip(got, order, strict=True):
        assert torch.equal(bx, x[idx]) and torch.equal(by, y[idx])


def test_no_shuffle_yields_views() -> None:
    x, y = data(10)
    loader = make_loader((x, y), 4, shuffle=False, device="cpu")
    assert isinstance(loader, TensorLoader)
    got = list(loader)
    assert [len(b[0]) for b in got] == [4, 4, 2]  # drop_last auto = shuffle = False
    for i, (bx, by) in enumerate(got):
        assert bx.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert by.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        assert torch.equal(bx, x[i * 4:(i + 1) * 4]) and torch.equal(by, y[i * 4:(i + 1) * 4])


def test_shuffled_batches_are_copies() -> None:
    x, y = data(10)
    bx, _ = next(iter(TensorLoader((x, y), 4, shuffle=True)))
    assert bx.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize(("shuffle", "drop_last", "sizes"), [
    (False, False, [4, 4, 2]),
    (False, True, [4, 4]),
    (True, False, [4, 4, 2]),
    (True, True, [4, 4]),
])
def test_drop_last(shuffle: bool, drop_last: bool, sizes: list[int]) -> None:
    x, y = data(10)
    loader = TensorLoader((x, y), 4, shuffle=shuffle, drop_last=drop_last)
    assert [len(b[0]) for b in loader] == sizes
    assert len(loader) == len(sizes)
    via_make = make_loader((x, y), 4, shuffle=shuffle, drop_last=drop_last, device="cpu")
    assert [len(b[0]) for b in via_make] == sizes


@pytest.mark.parametrize(("shuffle", "sizes"), [(True, [4, 4]), (False, [4, 4, 2])])
def test_drop_last_auto_follows_shuffle(shuffle: bool, sizes: list[int]) -> None:
    loader = make_loader(data(10), 4, shuffle=shuffle, device="cpu")
    assert [len(b[0]) for b in loader] == sizes


def test_epochs_and_start_at() -> None:
    x, y = data(12)
    loader = TensorLoader((x, y), 3, shuffle=True, seed=1)
    e0, e1 = list(loader), list(loader)
    assert not torch.equal(torch.cat([b[0] for b in e0]), torch.cat([b[0] for b in e1]))
    loader.set_epoch(0)
    loader.start_at(2)
    tail = list(loader)
    assert len(tail) == 2
    for (ax, ay), (bx, by) in zip(tail, e0[2:], strict=True):
        assert torch.equal(ax, bx) and torch.equal(ay, by)
    again = list(loader)  # epoch 1, from its start
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, e1, strict=True))


def test_single_tensor() -> None:
    x = torch.arange(6)
    loader = make_loader([x], 2, shuffle=False, device="cpu")
    assert isinstance(loader, TensorLoader)
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize(("tensors", "sizes", "rows"), [
    ((torch.zeros(6, 2), torch.zeros(5)), [6, 5], 6),
    ((torch.zeros(3), torch.zeros(3), torch.zeros(4)), [3, 3, 4], 3),
])
def test_mismatched_first_dimensions(tensors: tuple[torch.Tensor, ...], sizes: list[int], rows: int) -> None:
    message = f"tensors disagree on their first dimension: {sizes}; they must all have {rows} rows"
    with pytest.raises(ValueError, match=re.escape(message)):
        TensorLoader(tensors, 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        make_loader(tensors, 2, device="cpu")


def test_no_tensors() -> None:
    with pytest.raises(ValueError, match="TensorLoader needs at least one tensor"):
        TensorLoader((), 2)


def test_bad_batch_size() -> None:
    with pytest.raises(ValueError, match=re.escape("batch_size=0 is not valid; use a positive integer")):
        TensorLoader(data(), 0)
