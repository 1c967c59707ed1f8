"""Open handles on a dataset, found by a bounded walk of its attributes before the DataLoader workers fork.

Workers are forked from the training process, so a handle opened on the dataset before `iter(loader)` (a
sqlite3 connection, an lmdb environment, an h5py file, an open zip or tar archive, a file object) is shared by
every worker: the same connection or file offset used from several processes corrupts reads or deadlocks.
`find_handles` names each one by its attribute path (`dataset.store.conn`, `dataset.datasets[1].db`), so that
`db_handles_check` (checks.py) can say which attribute to open lazily; `handle_kind` says what a value is.

The walk is reflective but has no side effects and is bounded: it reads instance `__dict__`s and `__slots__`
directly (no properties, no `__getattr__`, so nothing is opened or read), goes `MAX_DEPTH` attributes deep, looks
at the first `MAX_ITEMS` members of each dict, list or tuple, visits at most `MAX_NODES` objects, and does not
descend into scalars, tensors, numpy arrays, classes, modules, functions or loggers.
"""

from __future__ import annotations

import io
import logging
import sqlite3
import sys
import tarfile
import types
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

# How far to look: dataset.a.b.c (covers Subset(ds).dataset.db and ConcatDataset(...).datasets[0].db).
MAX_DEPTH = 3
MAX_ITEMS = 256  # per container: a dataset's list of a million file names is not worth scanning
MAX_NODES = 5000
_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor, memoryview, range)
_NO_DESCENT = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               logging.Logger, logging.Handler)
_IN_MEMORY_FILES = (io.BytesIO, io.StringIO)


def _is_open(obj: Any, attribute: str) -> bool:
    try:
        return not bool(getattr(obj, attribute))
    except Exception:
        return True  # cannot tell: better named than missed


def handle_kind(obj: Any) -> str | None:
    """What kind of fork-unsafe open handle `obj` is ("a sqlite3.Connection", ...), or None.

    Looks at `type(obj)` only (never `obj.__class__`, which a proxy may override), and imports no optional
    library: lmdb and h5py objects are recognised by their type's module and name.
    """
    cls = type(obj)
    module = (getattr(cls, "__module__", "") or "").split(".")[0]
    name = getattr(cls, "__name__", "")
    if issubclass(cls, sqlite3.Connection):
        try:
            obj.total_changes  # noqa: B018 - raises ProgrammingError once the connection is closed
        except sqlite3.ProgrammingError:
            return None
        except Exception:
            pass
        return "a sqlite3.Connection"
    if module == "lmdb" and name == "Environment":
        return "an lmdb Environment"
    if module == "h5py" and name == "File":
        return "an open h5py.File"
    if issubclass(cls, zipfile.ZipFile):
        return "an open zipfile.ZipFile" if getattr(obj, "fp", None) is not None else None
    if issubclass(cls, tarfile.TarFile):
        return None if getattr(obj, "closed", True) else "an open tarfile.TarFile"
    if issubclass(cls, io.IOBase) and not issubclass(cls, _IN_MEMORY_FILES):
        if not _is_open(obj, "closed") or any(obj is s for s in (sys.stdin, sys.stdout, sys.stderr)):
            return None
        try:
            if obj.fileno() in (0, 1, 2):
                return None
        except Exception:
            pass
        return "an open file"
    return None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, value) for the members of a container or the instance attributes of an object."""
    cls = type(obj)
    if issubclass(cls, dict):
        for i, (key, value) in enumerate(dict.items(obj)):
            if i >= MAX_ITEMS:
                return
            yield f"[{key!r}]", value
        return
    if issubclass(cls, (list, tuple)):
        items = list.__iter__(obj) if issubclass(cls, list) else tuple.__iter__(obj)
        for i, value in enumerate(items):
            if i >= MAX_ITEMS:
                return
            yield f"[{i}]", value
        return
    if issubclass(cls, (set, frozenset)):
        return  # unordered, unnamed: a handle in a set has no path to name
    try:
        attributes = object.__getattribute__(obj, "__dict__")
    except Exception:
        attributes = None
    if isinstance(attributes, dict):
        for i, (key, value) in enumerate(list(attributes.items())):
            if i >= MAX_ITEMS:
                return
            yield f".{key}", value
    for slot in _slots(cls):
        try:
            yield f".{slot}", object.__getattribute__(obj, slot)
        except Exception:
            continue


def _slots(cls: type) -> list[str]:
    names: list[str] = []
    for klass in getattr(cls, "__mro__", ()):
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")])
    return names


def find_handles(dataset: object, root: str = "dataset") -> list[tuple[str, str]]:
    """(attribute path, kind) for each open handle reachable from `dataset`'s attributes. Reads instance
    attributes directly (no properties, no `__getattr__`), so it never triggers I/O or a lazy open."""
    found: list[tuple[str, str]] = []
    seen = {id(dataset)}
    stack: list[tuple[Any, str, int]] = [(dataset, root, 0)]
    nodes = 0
    while stack and nodes < MAX_NODES:
        obj, path, depth = stack.pop()
        nodes += 1
        try:
            children = list(_children(obj))
        except Exception:
            continue
        for suffix, value in reversed(children):
            child = path + suffix
            try:
                kind = handle_kind(value)
            except Exception:
                kind = None
            if kind is not None:
                found.append((child, kind))  # every path to it: the user may fix either attribute
            elif depth + 1 < MAX_DEPTH and id(value) not in seen and not _is_array(value) \
                    and not issubclass(type(value), _SCALARS + _NO_DESCENT):
                seen.add(id(value))
                stack.append((value, child, depth + 1))
    return sorted(found)


def _is_array(value: Any) -> bool:
    return (getattr(type(value), "__module__", "") or "").startswith("numpy")
