"""What the loop sets on a DataLoader's dataset once the loader has started (a curriculum lowering `ds.noise` each
step, an `epoch` attribute set before each epoch). Worker processes hold a copy of the dataset made when they start:
such a change reaches the main process's dataset only, so more workers, or workers kept between epochs, would train
on what the dataset was when they started (fixes/input.py `unseen_by_workers` says so in their fixes).

How: when a DataLoader's first iterator starts, `vars()` of its dataset (and of the datasets it holds, a `Subset`'s)
is noted; at each later `iter()` and when the run ends (`check`) it is compared, and the names whose value changed,
appeared or went are added to the loader's `LoaderStats.dataset_set_after_start`. Nothing per batch, nothing on the
dataset itself (its class, pickling for spawned workers, `isinstance` and `__getitem__` stay the script's). What is
noted of a value: a number or a string itself (compared by value: `ds.epoch = 3` twice is no change), else a weak
reference (a tensor, an array, an object: replaced, it is another object), or, for what takes no weak reference (a
list, a dict, a tuple), the object itself until the next comparison. A change undone before the next comparison, or
a list changed in place, is not seen."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
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


class DatasetWatch:
    """The datasets of the loaders started, as they were when last compared."""

    def __init__(self) -> None:
        self._noted: list[tuple[LoaderStats, Any, dict[str, dict[str, Token]]]] = []
        self._by_stats: dict[int, int] = {}

    def started(self, stats: LoaderStats, dataset: Any) -> None:
        """A DataLoader's `iter()` just made its iterator: note its dataset the first time, compare it after."""
        index = self._by_stats.get(id(stats))
        if index is None:
            self._by_stats[id(stats)] = len(self._noted)
            self._noted.append((stats, dataset, _note(dataset)))
        else:
            self._compare(index)

    def check(self) -> None:
        """Compare every dataset noted (the run is ending)."""
        for index in range(len(self._noted)):
            self._compare(index)

    def clear(self) -> None:
        self._noted.clear()
        self._by_stats.clear()

    def _compare(self, index: int) -> None:
        stats, dataset, noted = self._noted[index]
        now = _note(dataset)
        changed = set(stats.dataset_set_after_start)
        for prefix in noted.keys() | now.keys():
            before, after = noted.get(prefix, {}), _vars(_holder(dataset, prefix))
            for name in before.keys() | after.keys():
                if name not in before or name not in after or not _same(before[name], after[name]):
                    changed.add(prefix + name)
        stats.dataset_set_after_start = sorted(changed)
        self._noted[index] = (stats, dataset, now)


def _note(dataset: Any) -> dict[str, dict[str, Token]]:
    return {prefix: {name: _token(value) for name, value in _vars(held).items()}
            for prefix, held in _datasets(dataset)}


def _holder(dataset: Any, prefix: str) -> Any:
    """The dataset a prefix names ("" the loader's, "dataset." a Subset's), None where it is gone."""
    held = dataset
    for part in filter(None, prefix.split(".")):
        held = _vars(held).get(part)
    return held
