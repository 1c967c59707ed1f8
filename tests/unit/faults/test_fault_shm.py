"""A /dev/shm too small for the workers' batches is handled before the first batch: `make_loader` lowers
prefetch_factor (and says so), or refuses with a `LoaderError` before any worker starts. /dev/shm is faked
by monkeypatching `trainfast.loader.faults.read_shm_bytes`."""

from __future__ import annotations

import logging
import multiprocessing
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from trainfast.data.images import ImageFolder
from trainfast.envcheck import estimate_batch_bytes
from trainfast.loader import Loader, LoaderError, faults, make_loader
from trainfast.loader.auto import plan_loader
from trainfast.loader.faults import fit_shared_memory

pytestmark = pytest.mark.timeout(60)  # every test here has a hard limit; worker tests set their own

MIB, GIB = 2**20, 2**30


class Counting(Dataset[torch.Tensor]):
    """Counts fetches: a refused loader must never have fetched anything."""

    def __init__(self, n: int = 32, sample_bytes: int | None = None) -> None:
        self.n, self.calls = n, 0
        if sample_bytes is not None:
            self.sample_bytes = sample_bytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls += 1
        return torch.tensor([float(i)])




def shm(monkeypatch: pytest.MonkeyPatch, free: int | None) -> None:
    monkeypatch.setattr(faults, "read_shm_bytes", lambda: free)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainfast" and r.levelno == logging.WARNING]


def worker_loader(dataset: Dataset[Any], workers: int = 2, **kwargs: Any) -> Loader:
    loader = make_loader(dataset, 4, workers=workers, device="cpu", **kwargs)
    assert isinstance(loader, Loader)
    return loader


def plan(workers: int = 2, prefetch: int | str = 4) -> Any:
    return plan_loader(workers=workers, pin_memory=False, prefetch_factor=prefetch,  # type: ignore[arg-type]
                       persistent_workers="auto", drop_last="auto", shuffle=True, dataset_len=1000,
                       in_memory=False, target="cpu", cpus=2)


# ------------------------------------------------------------------------------------------------ make_loader

@pytest.mark.timeout(30)
def test_docker_default_shm_lowers_prefetch_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                        trainfast_log: pytest.LogCaptureFixture) -> None:
    shm(monkeypatch, 64 * MIB)
    loader = worker_loader(Counting(), prefetch_factor=4)
    assert loader.plan.prefetch_factor == loader.dataloader.prefetch_factor == 2
    assert "prefetch_factor=2 (lowered from 4: /dev/shm has 64.0 MiB free (< 256.0 MiB); 4 batches in flight)" \
        in loader.plan.describe()
    [warning] = warnings_of(trainfast_log)
    assert "/dev/shm has 64.0 MiB free" in warning and "prefetch_factor lowered from 4 to 2" in warning
    assert "--shm-size=8g" in warning and "--ipc=host" in warning
    assert loader.dataloader._iterator is None  # nothing started yet


@pytest.mark.timeout(30)
def test_small_shm_and_a_known_batch_size_lowers_prefetch_to_one(monkeypatch: pytest.MonkeyPatch,
                                                                 trainfast_log: pytest.LogCaptureFixture) -> None:
    shm(monkeypatch, 64 * MIB)
    loader = worker_loader(Counting(sample_bytes=int(2.5 * MIB)))  # 10 MiB batches: 2 x 2 x 10 x 2 = 80 > 64
    assert loader.plan.prefetch_factor == 1
    assert "need about 80.0 MiB at prefetch_factor=2" in loader.plan.describe()
    assert "10.0 MiB per batch" in warnings_of(trainfast_log)[0]


@pytest.mark.timeout(30)
def test_batches_that_cannot_fit_stop_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    shm(monkeypatch, 64 * MIB)
    rows = torch.zeros(1, dtype=torch.uint8).expand(64, 5 * MIB)  # 5 MiB per sample, without allocating them
    children = set(multiprocessing.active_children())
    with pytest.raises(LoaderError) as info:
        make_loader(TensorDataset(rows), 4, workers=2, device="cpu")  # 20 MiB batches: 2 x 1 x 20 x 2 = 80 > 64
    message = str(info.value)
    assert info.value.kind == "shared_memory"
    assert "/dev/shm has 64.0 MiB free but num_workers=2 need about 80.0 MiB" in message
    assert "even at prefetch_factor=1 (2 workers x 1 x 20.0 MiB per batch x 2)" in message
    assert "no worker was started" in message
    assert "--shm-size=8g" in message and "workers=1 (at most 1 fit at prefetch_factor=1)" in message
    assert "smaller batch_size" in message and "workers=0" in message
    assert 'global setting trainfast does not change for you: torch.multiprocessing.set_sharing_strategy(' \
        '"file_system")' in message
    assert set(multiprocessing.active_children()) == children


@pytest.mark.timeout(30)
def test_a_refused_map_dataset_was_never_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    shm(monkeypatch, 8 * MIB)
    dataset = Counting(sample_bytes=2 * MIB)
    with pytest.raises(LoaderError, match=re.escape("/dev/shm has 8.0 MiB free")):
        worker_loader(dataset)
    assert dataset.calls == 0


@pytest.mark.timeout(30)
def test_image_folder_declares_its_sample_size(monkeypatch: pytest.MonkeyPatch, tiny_images: Path) -> None:
    dataset = ImageFolder(tiny_images / "val", image_size=256)
    assert dataset.sample_bytes == 3 * 256 * 256 + 8
    shm(monkeypatch, 16 * GIB)
    loader = worker_loader(dataset, persistent_workers=False)
    assert estimate_batch_bytes(loader) == 4 * dataset.sample_bytes  # the pre-flight check sees it too
    shm(monkeypatch, 2 * MIB)  # 4 x 192 KiB batches: 2 workers x 1 x 0.75 MiB x 2 = 3 MiB > 2 MiB
    with pytest.raises(LoaderError, match=re.escape("need about 3.0 MiB of it even at prefetch_factor=1")):
        worker_loader(dataset)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("free", [16 * GIB, None], ids=["plenty", "unreadable"])
def test_enough_or_unknown_shm_changes_nothing(monkeypatch: pytest.MonkeyPatch,
                                               trainfast_log: pytest.LogCaptureFixture, free: int | None) -> None:
    shm(monkeypatch, free)
    loader = worker_loader(Counting(), prefetch_factor=4)
    assert loader.plan.prefetch_factor == 4 and "lowered" not in loader.plan.describe()
    assert warnings_of(trainfast_log) == []


@pytest.mark.timeout(30)
def test_no_workers_no_shm_check(monkeypatch: pytest.MonkeyPatch, trainfast_log: pytest.LogCaptureFixture) -> None:
    shm(monkeypatch, 1 * MIB)
    rows = torch.zeros(1, dtype=torch.uint8).expand(64, 5 * MIB)
    assert len(list(worker_loader(Counting(), workers=0))) == 8
    make_loader(TensorDataset(rows), 4, device="cpu")  # the in-memory path: no workers, no /dev/shm
    assert warnings_of(trainfast_log) == []


# -------------------------------------------------------------------------------------- fit_shared_memory itself

@pytest.mark.parametrize(("free", "batch_bytes", "prefetch", "expected"), [
    (64 * MIB, None, 4, 2),          # tiny, size unknown: torch's default 2
    (64 * MIB, None, 2, 2),          # already 2: kept, still warned
    (64 * MIB, None, 1, 1),
    (64 * MIB, 10 * MIB, 4, 1),      # 2 x 2 x 10 x 2 = 80 MiB > 64: down to 1 (40 MiB)
    (64 * MIB, 1 * MIB, 4, 2),       # 2 x 2 x 1 x 2 = 8 MiB fits, but /dev/shm is under the floor: 2
    (1 * GIB, 100 * MIB, 4, 2),      # not tiny, but 2 x 4 x 100 x 2 = 1600 MiB > 1 GiB: 2 fits (800 MiB)
    (1 * GIB, 1 * MIB, 4, 4),        # fits: unchanged
])
def test_fit_shared_memory(free: int, batch_bytes: int | None, prefetch: int, expected: int) -> None:
    before = plan(prefetch=prefetch)
    after, warning = fit_shared_memory(before, free, batch_bytes)
    assert after.prefetch_factor == expected
    assert after.num_workers == before.num_workers and after.persistent_workers == before.persistent_workers
    assert len(after.reasons) == len(before.reasons)
    assert bool(warning) == (free < 256 * MIB or expected != prefetch)
    if expected != prefetch:
        assert f"prefetch_factor={expected} (lowered from {prefetch}" in after.describe()


def test_fit_shared_memory_leaves_loaders_without_workers_alone() -> None:
    no_workers = plan(workers=0)
    assert fit_shared_memory(no_workers, 1, 10 * GIB) == (no_workers, "")


def test_fit_shared_memory_without_room_for_a_single_worker() -> None:
    with pytest.raises(LoaderError) as info:
        fit_shared_memory(plan(workers=2), 64 * MIB, 64 * MIB)
    assert "at most" not in str(info.value)  # no worker count fits: the fixes are more shm, smaller batches, 0
    assert "workers=0 (no shared memory at all)" in str(info.value)
