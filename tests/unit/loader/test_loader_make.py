"""make.py: `Loader` epochs and resume, the logged plan, input validation, how "auto" reaches the plan."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from helpers import Draws, assert_same
from trainfast.loader import Loader, TensorLoader, make_loader
from trainfast.loader.auto import TINY_DATASET
from trainfast.loader.prefetch import Normalize


def test_each_iter_is_the_next_epoch_unless_set_epoch() -> None:
    loader = make_loader(Draws(), 4, workers=0, device="cpu", seed=1)
    assert isinstance(loader, Loader)
    e0 = list(loader)
    assert loader.batches.epoch == 0
    e1 = list(loader)
    assert loader.batches.epoch == 1
    assert not torch.equal(torch.cat(e0), torch.cat(e1))
    loader.set_epoch(0)
    assert_same(list(loader), e0)
    assert_same(list(loader), e1)  # and on from there
    loader.set_epoch(7)
    list(loader)
    assert loader.batches.epoch == 7
    list(loader)
    assert loader.batches.epoch == 8


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("start", [0, 2, 5])
def test_start_at_yields_the_tail_of_the_uninterrupted_epoch(workers: int, start: int) -> None:
    full = list(make_loader(Draws(), 4, workers=workers, device="cpu", seed=4, persistent_workers=False))
    assert len(full) == 5  # 22 samples, drop_last (shuffle): 5 batches
    loader = make_loader(Draws(), 4, workers=workers, device="cpu", seed=4, persistent_workers=False)
    loader.start_at(start)
    assert_same(list(loader), full[start:])
    assert len(list(loader)) == 5  # the next epoch starts at batch 0 again


def test_an_ended_epoch_s_workers_go_on_into_the_next_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    def epoch(e: int) -> list[torch.Tensor]:
        alone = make_loader(Draws(), 4, workers=0, device="cpu", seed=4)
        alone.set_epoch(e)
        return list(alone)

    loader = make_loader(Draws(), 4, workers=2, device="cpu", seed=4)
    assert_same(list(loader), epoch(0))
    it = loader.dataloader._iterator
    resets: list[int] = []
    reset = type(it)._reset  # type: ignore[union-attr]
    monkeypatch.setattr(type(it), "_reset", lambda self, *a, **k: resets.append(1) or reset(self, *a, **k))
    assert_same(list(loader), epoch(1))  # taken over from the first epoch's end: not reset, nothing dropped
    assert resets == []
    loader.set_epoch(5)  # another epoch than the one made ahead: reset, made afresh
    assert_same(list(loader), epoch(5))
    loader.start_at(2)  # a resume point: the same
    assert_same(list(loader), epoch(6)[2:])
    assert len(resets) == 2
    loader.close()
    assert loader.dataloader._iterator is None
    ending = make_loader(Draws(), 4, workers=2, device="cpu", seed=4, persistent_workers=False)
    epoch_it = iter(ending)
    assert_same(list(epoch_it), epoch(0))
    workers = list(epoch_it._it._workers)  # type: ignore[attr-defined]
    assert ending._ahead is None and not any(w.is_alive() for w in workers)  # as asked: they end with the epoch


def test_close_stops_persistent_workers_and_iterating_again_restarts_them() -> None:
    loader = make_loader(Draws(), 4, workers=2, device="cpu", persistent_workers=True, seed=6)
    first = list(loader)
    workers = list(loader.dataloader._iterator._workers)  # type: ignore[union-attr]
    assert workers and all(w.is_alive() for w in workers)
    loader.close()
    assert loader.dataloader._iterator is None
    assert not any(w.is_alive() for w in workers)
    loader.close()  # twice is fine
    loader.set_epoch(0)
    try:
        assert_same(list(loader), first)  # new workers, same batches
    finally:
        loader.close()


class _Queue:
    def __init__(self) -> None:
        self.closed = False

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _StoppingIterator:
    """A worker iterator whose shutdown is interrupted, as torch's is when a worker dies while it stops."""

    def __init__(self, error: str) -> None:
        self.error = error
        self._index_queues = [_Queue(), _Queue()]
        self._workers: list[Any] = []

    def _shutdown_workers(self) -> None:
        raise RuntimeError(self.error)


def test_a_worker_dying_while_the_workers_stop_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    # Seen with 'spawn' workers stopped while making the next epoch's batches: "terminate called without an active
    # exception" in the worker, then torch's SIGCHLD handler raised out of close() and left its queues open.
    loader = make_loader(Draws(), 4, workers=0, device="cpu")
    stopping = _StoppingIterator("DataLoader worker (pid 4291) is killed by signal: Aborted. ")
    loader.dataloader._iterator = stopping  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="trainfast"):
        loader.close()
    assert "a worker died while the workers were stopped (DataLoader worker (pid 4291)" in caplog.text
    assert all(queue.closed for queue in stopping._index_queues)  # their feeder threads end
    loader.dataloader._iterator = _StoppingIterator("something else")  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="something else"):
        loader.close()


def test_close_without_workers_is_a_no_op() -> None:
    loader = make_loader(Draws(), 4, workers=0, device="cpu")
    loader.close()
    assert len(list(loader)) == 5


def test_start_at_a_later_epoch() -> None:
    reference = make_loader(Draws(), 4, workers=0, device="cpu", seed=4)
    reference.set_epoch(3)
    full = list(reference)
    loader = make_loader(Draws(), 4, workers=0, device="cpu", seed=4)
    loader.set_epoch(3)
    loader.start_at(1)
    assert_same(list(loader), full[1:])


def test_start_at_out_of_range() -> None:
    loader = make_loader(Draws(), 4, workers=0, device="cpu")
    with pytest.raises(ValueError, match=re.escape("start batch 6 is outside the epoch's 5 batches")):
        loader.start_at(6)


@pytest.mark.parametrize(("shuffle", "drop_last", "expected"), [
    (True, "auto", 5), (False, "auto", 6), (True, False, 6), (False, True, 5),
])
def test_len_and_plan(shuffle: bool, drop_last: bool | str, expected: int) -> None:
    loader = make_loader(Draws(22), 4, workers=0, device="cpu", shuffle=shuffle, drop_last=drop_last)
    assert len(loader) == expected
    assert len(list(loader)) == expected
    assert loader.plan.drop_last is (expected == 5)
    assert loader.plan.num_workers == 0 and loader.plan.prefetch_factor is None
    assert not loader.plan.pin_memory and not loader.plan.in_memory
    assert loader.batch_size == 4


def test_plan_of_a_worker_loader() -> None:
    loader = make_loader(Draws(), 4, workers=2, device="cpu", persistent_workers=False)
    p = loader.plan
    assert (p.num_workers, p.persistent_workers, p.prefetch_factor, p.pin_memory) == (2, False, 2, False)
    assert loader.dataloader.num_workers == 2 and loader.dataloader.prefetch_factor == 2
    assert not loader.dataloader.persistent_workers


def test_small_dataset_auto_plan() -> None:
    loader = make_loader(Draws(TINY_DATASET - 1), 8, device="cpu")
    assert loader.plan.num_workers == 0
    assert f"{TINY_DATASET - 1} samples" in loader.plan.describe()


class Sized(Dataset[int]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 15 workers on this small machine
@pytest.mark.parametrize(("cpus", "local_world", "device", "workers", "pin"), [
    (16, None, "cuda", 15, True),
    (16, "4", "cuda", 3, True),     # torchrun: 4 processes share the CPUs
    (16, None, "cuda:1", 15, True),
    (16, None, torch.device("cuda", 0), 15, True),
    (16, None, "cpu", 8, False),
    (2, "8", "cuda", 1, True),
])
def test_auto_settings_reach_the_plan(monkeypatch: pytest.MonkeyPatch, cpus: int, local_world: str | None,
                                      device: Any, workers: int, pin: bool) -> None:
    monkeypatch.setattr("trainfast.loader.resolve.available_cpus", lambda: cpus)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    loader = make_loader(Sized(), 8, device=device)  # built, never iterated: no workers start
    assert isinstance(loader, Loader)
    assert loader.plan.num_workers == workers
    assert loader.plan.pin_memory is pin
    assert loader.dataloader.num_workers == workers
    assert loader.dataloader.pin_memory is pin


def test_rank_and_world_size_default_to_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = make_loader(Draws(12), 2, workers=0, device="cpu")
    assert (loader.batches.rank, loader.batches.world_size) == (1, 3)
    assert len(loader) == 2
    explicit = make_loader(Draws(12), 2, workers=0, device="cpu", rank=0, world_size=1)
    assert (explicit.batches.rank, explicit.batches.world_size) == (0, 1)


def test_collate_fn_and_normalize_are_used() -> None:
    class WithNormalize(Draws):
        normalize = Normalize(mean=(0.5,), std=(0.25,))

    ds = WithNormalize(8)
    loader = make_loader(ds, 4, workers=0, device="cpu", shuffle=False, collate_fn=lambda samples: len(samples))
    assert list(loader) == [4, 4]
    assert loader.normalize == Normalize(mean=(0.5,), std=(0.25,))
    mine = Normalize()
    assert make_loader(ds, 4, workers=0, device="cpu", normalize=mine).normalize is mine
    assert make_loader(Draws(8), 4, workers=0, device="cpu").normalize is None


def test_plain_sequence_of_samples_is_batched_or_refused_clearly() -> None:
    """A list of samples is a valid map-style dataset for DataLoader: batch it, or say why not (no bare assert)."""
    samples = [(i, i * 10) for i in range(6)]
    try:
        loader = make_loader(samples, 3, workers=0, device="cpu", shuffle=False)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        assert "list" in str(e)
    else:
        first = next(iter(loader))
        assert first[0].tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------------- logging



def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainfast" and r.levelno == logging.INFO]


def test_make_loader_logs_its_plan(trainfast_log: pytest.LogCaptureFixture) -> None:
    loader = make_loader(Draws(), 4, workers=0, device="cpu")
    assert f"make_loader: {loader.plan.describe()}" in _messages(trainfast_log)


def test_in_memory_path_logs_its_plan(trainfast_log: pytest.LogCaptureFixture) -> None:
    loader = make_loader(TensorDataset(torch.zeros(10, 2)), 4, device="cpu")
    assert isinstance(loader, TensorLoader) and loader.plan is not None
    assert f"make_loader: in-memory path; {loader.plan.describe()}" in _messages(trainfast_log)


# ------------------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 0}, "batch_size=0 is not valid; use a positive integer"),
    ({"batch_size": -4}, "batch_size=-4 is not valid; use a positive integer"),
    ({"batch_size": 2.5}, "batch_size=2.5 is not valid; use a positive integer"),
    ({"batch_size": "64"}, "batch_size='64' is not valid; use a positive integer"),
    ({"workers": -1}, "workers=-1 is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"workers": "many"}, "workers='many' is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"workers": 1.5}, "workers=1.5 is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"workers": None}, "workers=None is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"prefetch_factor": 0}, "prefetch_factor=0 is not valid; use 'auto' or an integer >= 1"),
    ({"prefetch_factor": "lots"}, "prefetch_factor='lots' is not valid; use 'auto' or an integer >= 1"),
    ({"device": "tpu"}, "device='tpu' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "tpu:0"}, "device='tpu:0' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "gpu"}, "device='gpu' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
], ids=lambda v: ",".join(f"{k}={x!r}" for k, x in v.items()) if isinstance(v, dict) else "")
@pytest.mark.parametrize("dataset", ["map", "tensors"])
def test_invalid_arguments(kwargs: dict[str, Any], message: str, dataset: str) -> None:
    args: dict[str, Any] = {"batch_size": 4, **kwargs}
    data: Any = Draws() if dataset == "map" else (torch.zeros(8, 2), torch.zeros(8))
    with pytest.raises(ValueError, match=re.escape(message)):
        make_loader(data, **args)


def test_invalid_rank_names_it() -> None:
    with pytest.raises(ValueError, match=re.escape("rank=2 is outside world_size=2")):
        make_loader(Draws(), 4, workers=0, device="cpu", rank=2, world_size=2)


@pytest.mark.parametrize(("kwargs", "message"), [
    # same rule as TrainConfig.device: the index after "cuda:" must be a number, and only cuda takes one
    ({"device": "cuda:"}, "device='cuda:' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "cuda:x"}, "device='cuda:x' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": "cpu:0"}, "device='cpu:0' is not valid; use 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    # a bool is an int to isinstance, but workers=True is a mistake, not 1 worker (as TrainConfig.cpu_threads)
    ({"batch_size": True}, "batch_size=True is not valid; use a positive integer"),
    ({"workers": True}, "workers=True is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"workers": False}, "workers=False is not valid; use 'auto', 'tuned' or an integer >= 0"),
    ({"prefetch_factor": True}, "prefetch_factor=True is not valid; use 'auto' or an integer >= 1"),
], ids=lambda v: ",".join(f"{k}={x!r}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_invalid_arguments_consistent_with_train_config(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"batch_size": 4, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        make_loader(Draws(), **args)


def test_an_iterator_is_refused_with_its_type_named() -> None:
    with pytest.raises(TypeError, match=r"needs a map-style dataset .* got list_iterator"):
        make_loader(iter([1, 2, 3]), 2)
