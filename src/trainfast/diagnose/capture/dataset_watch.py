"""What the loop sets on a DataLoader's dataset once the loader has started (a curriculum lowering `ds.noise` each
step, an `epoch` attribute set before each epoch). Worker processes hold a copy of the dataset made when they start:
such a change reaches the main process's dataset only, so more workers, or workers kept between epochs, would train
on what the dataset was when they started (fixes/input.py `unseen_by_workers` says so in their fixes).

How: when a DataLoader's first iterator starts, `vars()` of its dataset (and of the datasets it holds, a `Subset`'s)
is noted; at each later `iter()` and when the run ends (`check`) it is compared, and the names whose value changed,
appeared or went are added to the loader's `LoaderStats.dataset_set_after_start`, but those the dataset's own code
sets while it makes a batch (a file opened on first use, a counter in `__getitem__`: each worker does that in its own
copy too), seen over the first `FETCHES` batches of each epoch made in this process (`Fetches`). Nothing after those
batches, nothing on the dataset itself (its class, pickling for spawned workers, `isinstance` and `__getitem__` stay
the script's). What is
noted of a value: a number or a string itself (compared by value: `ds.epoch = 3` twice is no change), else a weak
reference (a tensor, an array, an object: replaced, it is another object), or, for what takes no weak reference (a
list, a dict, a tuple), the object itself until the next comparison. A change undone before the next comparison, or
a list changed in place, is not seen."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

from trainfast.diagnose.records.steps import LoaderStats

_VALUES = (int, float, complex, bool, str, bytes, type(None))

Token = tuple[str, Any]  # ("=", a value) | ("ref", a weak reference) | ("obj", the object)


def _token(value: Any) -> Token:
    if type(value) in _VALUES:
        return "=", value
    try:
        return "ref", weakref.ref(value)
    except TypeError:
        return "obj", value


def _same(token: Token, value: Any) -> bool:
    kind, noted = token
    if kind == "=":
        return type(value) is type(noted) and (value == noted or (isinstance(value, float) and math.isnan(value)
                                                                  and math.isnan(noted)))
    return (noted() if kind == "ref" else noted) is value


def _datasets(dataset: Any, name: str = "", depth: int = 2) -> Iterator[tuple[str, Any]]:
    """The dataset and those it holds as attributes (a Subset's `dataset`), as (prefix, dataset)."""
    yield name, dataset
    if depth > 1:
        for key, value in _vars(dataset).items():
            if isinstance(value, Dataset):
                yield from _datasets(value, f"{name}{key}.", depth - 1)


def _vars(obj: Any) -> dict[str, Any]:
    try:
        return dict(vars(obj))
    except TypeError:  # __slots__, or a C type: nothing to note
        return {}


# The first batches of each epoch made in this process whose fetch is watched for what the dataset's own code sets
# (a file opened on first use, a counter): two notes a batch (~2 us for a dataset of 10 attributes), 3 batches an epoch
FETCHES = 3


@dataclass
class _Watched:
    stats: LoaderStats
    dataset: Any
    noted: dict[str, dict[str, Token]]
    own: set[str] = field(default_factory=set)  # names its own fetches set: not the loop's


class Fetches:
    """The first `FETCHES` batches of an epoch a loader makes in this process (no workers): what changes on the
    dataset while one is made is the dataset's own doing (`h5py.File` opened in `__getitem__`, a counter), which each
    worker does in its own copy too, not the loop's."""

    def __init__(self, watched: _Watched) -> None:
        self.watched, self.left = watched, FETCHES

    def before(self) -> dict[str, dict[str, Token]]:
        return _note(self.watched.dataset)

    def after(self, before: dict[str, dict[str, Token]]) -> bool:
        """The batch is made: what changed while it was is the dataset's own. False once enough are watched."""
        self.watched.own |= _changed(before, self.watched.dataset)
        self.left -= 1
        return self.left > 0


class DatasetWatch:
    """The datasets of the loaders started, as they were when last compared."""

    def __init__(self) -> None:
        self._watched: dict[int, _Watched] = {}  # by id() of the loader's stats

    def started(self, stats: LoaderStats, dataset: Any, *, in_process: bool) -> Fetches | None:
        """A DataLoader's `iter()` just made its iterator: note its dataset the first time, compare it after. The
        batches' fetches to watch where they are made in this process (`in_process`), else None."""
        watched = self._watched.get(id(stats))
        if watched is None:
            watched = self._watched[id(stats)] = _Watched(stats, dataset, _note(dataset))
        else:
            self._compare(watched)
        return Fetches(watched) if in_process else None

    def check(self) -> None:
        """Compare every dataset noted (the run is ending)."""
        for watched in self._watched.values():
            self._compare(watched)

    def clear(self) -> None:
        self._watched.clear()

    @staticmethod
    def _compare(watched: _Watched) -> None:
        changed = _changed(watched.noted, watched.dataset) - watched.own
        watched.stats.dataset_set_after_start = sorted(changed | set(watched.stats.dataset_set_after_start))
        watched.noted = _note(watched.dataset)


def _changed(noted: dict[str, dict[str, Token]], dataset: Any) -> set[str]:
    """The names (a held dataset's with its prefix) whose value changed, appeared or went since `noted`."""
    changed = set()
    for prefix in noted.keys() | {prefix for prefix, _ in _datasets(dataset)}:
        before, after = noted.get(prefix, {}), _vars(_holder(dataset, prefix))
        for name in before.keys() | after.keys():
            if name not in before or name not in after or not _same(before[name], after[name]):
                changed.add(prefix + name)
    return changed


def _note(dataset: Any) -> dict[str, dict[str, Token]]:
    return {prefix: {name: _token(value) for name, value in _vars(held).items()}
            for prefix, held in _datasets(dataset)}


def _holder(dataset: Any, prefix: str) -> Any:
    """The dataset a prefix names ("" the loader's, "dataset." a Subset's), None where it is gone."""
    held = dataset
    for part in filter(None, prefix.split(".")):
        held = _vars(held).get(part)
    return held
