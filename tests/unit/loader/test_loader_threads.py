"""threads.py: `backend="threads"` makes the same batches as worker processes and workers=0, in order, with a
bounded number in flight; failures surface at their batch; close() and a break leave no thread behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import Draws, assert_same
from trainfast import TrainConfig, Trainer
from trainfast.loader import ThreadLoader, make_loader


class Seeded(Draws):
    """Sample i: (i, a torch draw, a numpy draw, a Python draw), all from the batch's own generators."""

    def __init__(self, n: int = 30) -> None:
        super().__init__(n, ("torch", "numpy", "random"), dtype=torch.float64, per_batch=True)


class Concurrency(Seeded):
    """Records the most batches fetched at the same time (sample 0 of each batch marks its start)."""

    def __init__(self, n: int = 64) -> None:
        super().__init__(n)
        self.lock, self.active, self.most, self.calls = threading.Lock(), 0, 0, 0

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.lock:
            self.active += 1
            self.calls += 1
            self.most = max(self.most, self.active)
        time.sleep(0.002)
        with self.lock:
            self.active -= 1
        return super().__getitem__(i)


class Failing(Seeded):
    def path(self, index: int) -> str:
        return f"/data/{index}.jpg"

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13:
            raise ValueError("bad sample")
        return super().__getitem__(i)


def loader_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("trainfast-loader-")}


def epochs(loader: Any, n: int = 2) -> list[list[torch.Tensor]]:
    return [list(loader) for _ in range(n)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_same_batches_as_processes_and_no_workers(shuffle: bool) -> None:
    kw: dict[str, Any] = {"device": "cpu", "seed": 3, "shuffle": shuffle, "drop_last": False}
    threads = make_loader(Seeded(), 4, workers=2, backend="threads", **kw)
    assert isinstance(threads, ThreadLoader) and threads.plan.backend == "threads"
    reference = epochs(make_loader(Seeded(), 4, workers=0, **kw))
    assert_same(epochs(threads), reference)
    assert_same(epochs(make_loader(Seeded(), 4, workers=2, persistent_workers=False, **kw)), reference)
    one_ahead = make_loader(Seeded(), 4, workers=3, prefetch_factor=1, backend="threads", **kw)
    assert_same(epochs(one_ahead), reference)
    threads.close()
    one_ahead.close()  # the threads were making the third epoch's first batches
    assert not loader_threads()


def test_the_next_epoch_s_first_batches_are_made_during_this_one_s_last() -> None:
    kw: dict[str, Any] = {"device": "cpu", "seed": 3, "workers": 2, "prefetch_factor": 2}
    ds = Concurrency(32)  # 8 batches of 4 an epoch
    loader = make_loader(ds, 4, backend="threads", **kw)
    first = list(loader)
    deadline = time.monotonic() + 5
    while ds.calls < 32 + 4 * 4 and time.monotonic() < deadline:  # 4 batches of the next epoch in flight
        time.sleep(0.01)
    assert ds.calls == 32 + 4 * 4 and loader_threads()
    second = list(loader)  # taken over, not made again: 4 more batches, then the third epoch's 4 ahead
    reference = epochs(make_loader(Seeded(32), 4, **kw), 2)
    assert_same([first, second], reference)
    loader.set_epoch(7)  # not the epoch made ahead: it is dropped and epoch 7 made afresh
    assert_same([list(loader)], [epochs(make_loader(Seeded(32), 4, **kw), 8)[7]])
    loader.start_at(3)  # a resume point: the same
    assert_same([list(loader)], [epochs(make_loader(Seeded(32), 4, **kw), 9)[8][3:]])
    loader.close()
    assert not loader_threads()
    dropped = make_loader(Seeded(32), 4, backend="threads", **kw)
    list(dropped)
    del dropped  # never closed: collecting the loader stops the threads waiting between epochs
    deadline = time.monotonic() + 5
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loader_threads()


def test_image_folder_crops_and_flips_are_the_same_with_every_backend(tiny_images: Path) -> None:
    from trainfast.data.images import ImageFolder

    dataset = ImageFolder(tiny_images / "train", image_size=32)
    kw: dict[str, Any] = {"device": "cpu", "seed": 7}

    def images(loader: Any) -> list[list[torch.Tensor]]:
        return [[inputs for inputs, _ in loader]]

    reference = images(make_loader(dataset, 8, workers=0, **kw))
    threads = make_loader(dataset, 8, workers=2, backend="threads", **kw)
    assert_same(images(threads), reference)
    assert_same(images(make_loader(dataset, 8, workers=1, persistent_workers=False, **kw)), reference)
    threads.close()
    assert not loader_threads()


def test_the_main_thread_s_rng_streams_are_left_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    list(make_loader(Seeded(), 4, workers=2, backend="threads", device="cpu"))
    assert torch.equal(torch.rand(3), expected)


def test_set_epoch_and_start_at_as_the_processes_backend() -> None:
    kw: dict[str, Any] = {"device": "cpu", "seed": 5, "workers": 2}
    threads = make_loader(Seeded(), 4, backend="threads", **kw)
    procs = make_loader(Seeded(), 4, persistent_workers=False, **kw)
    for loader in (threads, procs):
        loader.set_epoch(3)
    e3 = list(procs)
    assert_same([list(threads)], [e3])
    threads.set_epoch(3)
    threads.start_at(2)
    assert_same([list(threads)], [e3[2:]])
    threads.set_epoch(0)
    assert not all(torch.equal(a, b) for a, b in zip(list(threads), e3, strict=True))


def test_in_flight_batches_are_bounded() -> None:
    ds = Concurrency()
    loader = make_loader(ds, 4, workers=2, prefetch_factor=2, backend="threads", device="cpu", shuffle=False)
    it = iter(loader)
    next(it)
    time.sleep(0.3)  # the threads fill the window, then wait for the consumer
    assert ds.calls <= 4 * (2 * 2 + 1)  # the batch taken, and 2 x 2 in flight
    assert ds.most <= 2
    rest = list(it)
    assert len(rest) == 15 and ds.most == 2


def test_an_error_surfaces_at_its_batch_naming_the_sample() -> None:
    loader = make_loader(Failing(), 4, workers=2, backend="threads", device="cpu", shuffle=False)
    it = iter(loader)
    assert [int(b[0, 0]) for b in (next(it), next(it), next(it))] == [0, 4, 8]
    with pytest.raises(ValueError, match="bad sample") as error:
        next(it)
    notes = "\n".join(getattr(error.value, "__notes__", []))
    assert "sample 13 (/data/13.jpg)" in notes and "[12, 13, 14, 15]" in notes and "batch 3" in notes
    assert not loader_threads()


def test_break_and_close_leave_no_thread() -> None:
    loader = make_loader(Seeded(200), 4, workers=2, backend="threads", device="cpu")
    for _ in loader:
        break
    loader.close()
    assert not loader_threads()
    for i, _ in enumerate(loader):  # dropped without close(): garbage collection stops them
        if i == 1:
            break
    deadline = time.monotonic() + 5
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not loader_threads()


def test_plan_and_validation() -> None:
    loader = make_loader(Seeded(), 4, workers=2, backend="threads", device="cpu")
    assert "backend=threads: 2 loader thread(s)" in loader.plan.describe()
    assert not loader.plan.persistent_workers
    none = make_loader(Seeded(), 4, workers=0, backend="threads", device="cpu")
    assert not isinstance(none, ThreadLoader) and "backend='threads' ignored" in none.plan.describe()
    with pytest.raises(ValueError, match="backend='fibers' is not valid; use 'auto', 'processes' or 'threads'"):
        make_loader(Seeded(), 4, backend="fibers")  # type: ignore[arg-type]


def test_trainer_trains_from_threads() -> None:
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    loader = make_loader([x, y], 8, workers=2, backend="threads", device="cpu")
    assert isinstance(loader, ThreadLoader)
    cfg = TrainConfig(epochs=2, device="cpu", progress=False, monitor=False)
    Trainer(nn.Linear(4, 2), config=cfg).fit(loader)
    assert not loader_threads()
