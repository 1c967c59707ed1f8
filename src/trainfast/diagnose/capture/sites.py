"""Where the script made what a fix changes (records/capture.py `Site`): the stack when it was made, read from the
innermost frame outwards, skipping torch, trainfast, the standard library and installed packages, to the first frame
of the script's own code. A framework's frame met on the way (transformers, Lightning, timm, accelerate) is kept as
its `framework`: the object was made by that framework, whose own setting decides it (fixes/where.py); so is a
framework that called the script's code (Lightning calling the user's `training_step`).

A frame's file is classified once (`_kind`, cached): a walk costs ~1 us a frame. The walks happen at the objects'
making (a DataLoader, the outermost module under construction, `.to()`) and at a few firsts (the first training
forward, the first evaluation forward, the first autocast block, the first checkpoint write), never per step.
`SiteMap` keeps a site per module by the module's identity (its class's `__hash__` may not work yet)."""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from trainfast.diagnose.records.capture import Site

# Package folders whose code is a framework's: its own settings make the loaders, the precision and the model
FRAMEWORKS = {"transformers": "transformers", "lightning": "lightning", "pytorch_lightning": "lightning",
              "lightning_fabric": "lightning", "timm": "timm", "accelerate": "accelerate"}
_LIBRARY_ROOTS = tuple(os.path.realpath(p) + os.sep for p in {
    os.path.dirname(torch.__file__), str(Path(__file__).resolve().parents[2]),  # torch, trainfast
    *(sysconfig.get_paths().get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib"))} if p)


@functools.lru_cache(maxsize=4096)
def _kind(filename: str) -> str:
    """ "user" (the script's own code), "library" (torch, trainfast, the standard library, an installed package) or
    the framework's name."""
    if filename.startswith("<"):  # <frozen runpy>, <string>: not a file a user edits
        return "library"
    path = os.path.realpath(filename)
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            package = parts[parts.index(marker) + 1] if parts.index(marker) + 1 < len(parts) else ""
            return FRAMEWORKS.get(package, "library")
    return "library" if path.startswith(_LIBRARY_ROOTS) else "user"


def _driven_by(frame: FrameType | None) -> str | None:
    """The framework that called the script's code (a Lightning hook: the user's `training_step` or
    `train_dataloader()`), whose setting decides what that code is asked to do; None where the script's own code
    drives it."""
    while frame is not None:
        kind = _kind(frame.f_code.co_filename)
        if kind not in ("user", "library"):
            return kind
        frame = frame.f_back
    return None


def site_of(what: str, frame: FrameType | None = None, *, owner: Any = None, index: int | None = None) -> Site | None:
    """The site of `what`, from `frame` (default: the caller's) outwards; frames whose `self` is `owner` are the
    object's own constructors (a module's `__init__` chain), not where it was made. None where no frame is the
    script's and no framework made it."""
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    framework = None
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind == "user" and (owner is None or f.f_locals.get("self") is not owner):
            filename = f.f_code.co_filename
            return Site(what, os.path.abspath(filename), f.f_lineno, linecache.getline(filename, f.f_lineno).strip(),
                        framework or _driven_by(f.f_back), index)
        if kind not in ("user", "library") and framework is None:
            framework = kind
        f = f.f_back
    return Site(what, None, None, "", framework, index) if framework is not None else None


class SiteMap:
    """A site for each module, held by the module's identity and dropped with it. Not a WeakKeyDictionary: that hashes
    the module, and a module's own `__hash__` may fail while its `__init__` runs (torchmetrics' `Metric` hashes state
    it sets after `nn.Module.__init__`: every Lightning script that logged a metric crashed under the doctor)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref[nn.Module], Site]] = {}

    def __setitem__(self, module: nn.Module, site: Site) -> None:
        key, by_id = id(module), self._by_id

        def drop(_: weakref.ref[nn.Module]) -> None:  # the module is gone (before its id can be reused)
            by_id.pop(key, None)
        by_id[key] = (weakref.ref(module, drop), site)

    def get(self, module: nn.Module) -> Site | None:
        entry = self._by_id.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else None

    def clear(self) -> None:
        self._by_id.clear()
