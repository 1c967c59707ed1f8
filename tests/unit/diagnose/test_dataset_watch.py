"""What the loop sets on a DataLoader's dataset after the loader started (capture/dataset_watch.py), in this process:
a curriculum's `ds.noise` each step, an `epoch` set before each epoch, a Subset's inner dataset; what is no change
(the same value set again, a NaN set again, a dataset never touched, what its own __getitem__ sets: a file opened
on first use, a counter); and the dataset left as the script made it
(its class, `isinstance`, pickling for spawned workers). Then the fixes that would add worker processes, or keep
them, say their workers would never see it (fixes/workers.py `warned`)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from trainfast.diagnose.capture.dataset_watch import DatasetWatch
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.fixes.workers import unseen_by_workers, warned
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.steps import LoaderStats


class Noisy(Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.x = torch.arange(16.0)
        self.noise, self.epoch, self.label, self.missing = 1.0, 0, "train", float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] + self.noise


def _stats() -> LoaderStats:
    return LoaderStats(0, "DataLoader", "Noisy", 0, False, False, None, 4, False, None)


def _iterate(dataset: Dataset[Any], change: Any, epochs: int = 2) -> LoaderStats:
    """Iterate a loader over `dataset` under the doctor's hooks, calling `change(dataset, epoch, step)` after each
    batch; the loader's stats as the run's end leaves them."""
    with Instrumentation(Timeline(warmup_steps=0)) as inst:
        loader = DataLoader(dataset, batch_size=4)
        for epoch in range(epochs):
            for step, _ in enumerate(loader):
                change(dataset, epoch, step)
    return inst.loaders[0]


def _curriculum(ds: Any, epoch: int, step: int) -> None:
    ds.noise *= 0.5


def test_a_curriculum_set_each_step_in_the_main_process_is_noted() -> None:
    ds = Noisy()
    stats = _iterate(ds, _curriculum)
    assert stats.dataset_set_after_start == ["noise"]
    assert type(ds) is Noisy and isinstance(ds, Noisy) and "noise" in vars(ds)  # the dataset is the script's
    assert pickle.loads(pickle.dumps(ds)).noise == ds.noise  # as a spawned worker would get it


def test_an_attribute_set_between_epochs_a_new_one_and_a_subsets_inner_dataset() -> None:
    def epochs(ds: Any, epoch: int, step: int) -> None:
        if step == 3:  # the epoch's last batch: set before the next iter()
            ds.epoch = epoch + 1
            ds.seen = True
    assert _iterate(Noisy(), epochs).dataset_set_after_start == ["epoch", "seen"]

    def inner(ds: Any, epoch: int, step: int) -> None:
        ds.dataset.label = f"epoch {epoch}"
    assert _iterate(Subset(Noisy(), range(8)), inner).dataset_set_after_start == ["dataset.label"]


@pytest.mark.parametrize("change", [
    lambda ds, epoch, step: None,  # never touched
    lambda ds, epoch, step: setattr(ds, "epoch", 0),  # the same value again
    lambda ds, epoch, step: setattr(ds, "missing", float("nan")),  # NaN again: no change
    lambda ds, epoch, step: ds.x.add_(0),  # in place: no assignment (and nothing a worker's copy misses: shared)
])
def test_no_change_is_noted_where_none_was_made(change: Any) -> None:
    assert _iterate(Noisy(), change).dataset_set_after_start == []


class LazyFile(Noisy):
    """Opens its "file" on first use and counts its reads, in __getitem__: what each worker does in its own copy."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if not hasattr(self, "handle"):
            self.handle = object()
        self.reads = getattr(self, "reads", 0) + 1
        return super().__getitem__(i)


def test_what_the_datasets_own_getitem_sets_is_not_the_loops() -> None:
    assert _iterate(LazyFile(), lambda ds, epoch, step: None).dataset_set_after_start == []
    assert _iterate(LazyFile(), _curriculum).dataset_set_after_start == ["noise"]


def test_a_replaced_tensor_is_a_change_and_threads_or_tensors_are_not_watched() -> None:
    watch = DatasetWatch()
    ds, stats = Noisy(), _stats()
    assert watch.started(stats, ds, in_process=False) is None  # workers make the batches: no fetch of ours to watch
    ds.x = ds.x.clone()  # another object, equal values: a worker's copy still holds the old one
    watch.check()
    assert stats.dataset_set_after_start == ["x"]
    del ds.label
    watch.started(stats, ds, in_process=False)  # the next iter(): compared, then noted afresh
    assert stats.dataset_set_after_start == ["label", "x"]


def test_the_workers_fixes_say_their_workers_would_not_see_it() -> None:
    stats = _stats()
    assert unseen_by_workers([stats], kept=False) is None
    stats.dataset_set_after_start = ["noise"]
    assert unseen_by_workers([stats], kept=False) == (
        "the loop sets Noisy.noise after loader #0 started; worker processes hold a copy of the dataset made when "
        "they start and never see it: more workers would train a different model")
    fix = warned(Recommendation("persistent_workers", "t", "why", "f", 1.1, overrides={"persistent_workers": True}),
                 [stats], kept=True)
    assert fix is not None and fix.changes_training is not None
    assert fix.changes_training.endswith("kept workers would train a different model")
    assert fix.why == f"why; but {fix.changes_training}"
    assert fix.to_json()["changes_training"] == fix.changes_training
    assert Recommendation.from_json(fix.to_json()).changes_training == fix.changes_training
