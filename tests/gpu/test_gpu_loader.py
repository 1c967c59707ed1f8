"""The input path on CUDA: `make_loader` with tensors in host memory and on the GPU, and `DevicePrefetcher`
against a plain `.to(device)` copy (with and without normalisation and channels_last, pinned and pageable)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainfast import DevicePrefetcher, TrainConfig, Trainer, make_loader
from trainfast.data import Normalize
from trainfast.loader import TensorLoader
from trainfast.loader.seeding import seed_all

ROWS, BATCH = 96, 16  # 6 full batches: drop_last drops nothing


def indexed_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Row i of the inputs is made from i, and target i is i: a batch's targets say which rows it must hold."""
    x = torch.arange(ROWS * 5, dtype=torch.float32).reshape(ROWS, 5)
    return x, torch.arange(ROWS)


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle", [True, False])
def test_in_memory_loader_with_host_tensors_feeds_the_gpu(shuffle: bool) -> None:
    x, y = indexed_rows()
    loader = make_loader((x, y), BATCH, shuffle=shuffle, device="cuda")
    assert isinstance(loader, TensorLoader) and loader.pin_memory  # target CUDA: page-locked batches
    for bx, by in loader:
        assert bx.device.type == "cpu" and bx.is_pinned() and by.is_pinned()
    seen = []
    for bx, by in DevicePrefetcher(loader, "cuda"):
        assert bx.device.type == "cuda" and by.device.type == "cuda"
        assert torch.equal(bx.cpu(), x[by.cpu()])
        seen.append(by.cpu())
    order = torch.cat(seen)
    assert sorted(order.tolist()) == list(range(ROWS))
    assert (order.tolist() == list(range(ROWS))) is not shuffle


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle", [True, False])
def test_in_memory_loader_with_cuda_tensors(shuffle: bool) -> None:
    """Tensors already on the GPU: batches are gathered there (no pinning, which only host memory allows)."""
    x, y = indexed_rows()
    xc, yc = x.cuda(), y.cuda()
    loader = make_loader((xc, yc), BATCH, shuffle=shuffle)
    batches = list(loader)
    assert len(batches) == ROWS // BATCH
    for bx, by in batches:
        assert bx.device == xc.device and by.device == yc.device
        assert torch.equal(bx, xc[by])
    order = torch.cat([by for _, by in batches]).cpu()
    assert sorted(order.tolist()) == list(range(ROWS))
    assert (order.tolist() == list(range(ROWS))) is not shuffle
    again = [by.cpu() for _, by in DevicePrefetcher(loader, "cuda")]  # the Trainer's path: nothing to copy
    assert sorted(torch.cat(again).tolist()) == list(range(ROWS))


@pytest.mark.gpu
def test_trainer_trains_from_cuda_tensors() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randint(0, 4, (128,), device="cuda", generator=generator)
    centers = torch.randn(4, 8, device="cuda", generator=generator) * 3
    x = centers[y] + torch.randn(128, 8, device="cuda", generator=generator)
    seed_all(0)
    trainer = Trainer(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)),
                      config=TrainConfig(epochs=5, lr=1e-2, device="cuda", progress=False, warmup_steps=2))
    result = trainer.fit(make_loader((x, y), 16), make_loader((x, y), 64, shuffle=False))
    assert result.steps == 5 * 8
    assert result.final_loss is not None and math.isfinite(result.final_loss)
    assert result.val_accuracy is not None and result.val_accuracy > 0.8


def reference(x: torch.Tensor, normalize: Normalize | None, channels_last: bool) -> torch.Tensor:
    """What the prefetcher must deliver, computed the plain way: `.to(device)`, then x/255, - mean, / std."""
    out = x.to("cuda")
    if normalize is not None:
        mean = torch.tensor(normalize.mean, device="cuda").view(1, -1, 1, 1)
        std = torch.tensor(normalize.std, device="cuda").view(1, -1, 1, 1)
        out = (out.float() / 255 - mean) / std
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out


def image_batches(count: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """uint8 image batches (every other one page-locked) with int64 labels."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for i in range(count):
        x = torch.randint(0, 256, (8, 3, size, size), dtype=torch.uint8, generator=generator)
        y = torch.randint(0, 10, (8,), generator=generator)
        batches.append((x.pin_memory(), y.pin_memory()) if i % 2 == 0 else (x, y))
    return batches


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [None, Normalize()], ids=["uint8", "normalized"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_prefetcher_matches_a_plain_copy(normalize: Normalize | None, channels_last: bool) -> None:
    batches = image_batches(6)
    got = list(DevicePrefetcher(batches, "cuda", normalize=normalize, channels_last=channels_last))
    assert len(got) == len(batches)
    for (x, y), (bx, by) in zip(batches, got, strict=True):
        expected = reference(x, normalize, channels_last)
        assert bx.device.type == "cuda" and bx.dtype == expected.dtype and bx.shape == expected.shape
        if channels_last:
            assert bx.is_contiguous(memory_format=torch.channels_last)
        if normalize is None:
            assert torch.equal(bx, expected)
        else:  # the prefetcher folds the arithmetic into one multiply-add: equal to within float rounding
            torch.testing.assert_close(bx, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(by, y.to("cuda"))


@pytest.mark.gpu
def test_prefetched_batches_stay_intact_while_the_next_copy_runs() -> None:
    """Batches are copied on a side stream one ahead: a batch dropped right after queuing work on it must not be
    overwritten by the next copy before that work ran (the allocator must know the compute stream uses it)."""
    batches = image_batches(24, size=64)
    weight = torch.randn(2048, 2048, device="cuda")
    sums = []
    for bx, _ in DevicePrefetcher(batches, "cuda"):
        busy = weight
        for _ in range(4):  # keep the compute stream busy, so the side stream's next copy runs meanwhile
            busy = busy @ weight / 2048
        sums.append(bx.sum(dtype=torch.float64))  # queued behind the busy work
        del bx
    expected = [float(x.sum(dtype=torch.float64)) for x, _ in batches]
    assert [float(s) for s in sums] == expected
