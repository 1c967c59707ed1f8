"""What `trainfast doctor --verify` injects into the unmodified script to measure a fix: DataLoader arguments, intra-op
threads, cudnn.benchmark, TF32, autocast off."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
from torch.utils.data import DataLoader

from trainfast.trainer.settings import set_tf32, torch_settings

log = logging.getLogger("trainfast.diagnose")


LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


SETTING_KEYS = ("threads", "cudnn_benchmark", "tf32", "autocast")


VALID_KEYS = LOADER_KEYS + SETTING_KEYS


# DataLoader arguments only valid with worker processes: a num_workers=0 override drops them.
WORKER_ONLY = ("persistent_workers", "prefetch_factor", "multiprocessing_context")


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` as a plain dict, or ValueError naming the unknown key or the bad value."""
    result = dict(overrides)
    for key, value in result.items():
        if key not in VALID_KEYS:
            raise ValueError(f"unknown override {key!r}; valid overrides: {', '.join(VALID_KEYS)}")
        if key in ("num_workers", "threads", "prefetch_factor"):
            low = 0 if key == "num_workers" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"override {key}={value!r}: give an integer >= {low}")
        elif not isinstance(value, bool):
            raise ValueError(f"override {key}={value!r}: give true or false")
        elif key == "autocast" and value:
            raise ValueError("override autocast=true: only false (the script's autocast off) can be injected")
    return result


def loader_arguments(arguments: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """DataLoader arguments (by parameter name) with the loader overrides applied, never an invalid mix:
    persistent_workers and prefetch_factor only apply with worker processes, and a num_workers=0 override
    drops the script's own worker-only arguments."""
    result = dict(arguments)
    workers = overrides.get("num_workers", result.get("num_workers", 0))
    for key in ("num_workers", "pin_memory"):
        if key in overrides:
            result[key] = overrides[key]
    if workers > 0:
        for key in ("persistent_workers", "prefetch_factor"):
            if key in overrides:
                result[key] = overrides[key]
    elif "num_workers" in overrides:
        for key in WORKER_ONLY:
            if result.get(key):
                result[key] = False if key == "persistent_workers" else None
    return result


def _patch_loader(stack: ExitStack, overrides: Mapping[str, Any]) -> None:
    original = DataLoader.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # a call the constructor rejects anyway: let it say why
            original(self, *args, **kwargs)
            return
        bound.arguments.update(loader_arguments(bound.arguments, overrides))
        original(*bound.args, **bound.kwargs)
    stack.enter_context(mock.patch.object(DataLoader, "__init__", __init__))


def _pin_threads(stack: ExitStack, threads: int) -> None:
    original = torch.set_num_threads
    owner = os.getpid()

    def set_num_threads(nthreads: int) -> None:
        if os.getpid() != owner:  # a forked DataLoader worker's own set_num_threads(1): let it through
            original(nthreads)
        else:
            log.debug("verify: ignored torch.set_num_threads(%s); the fix runs with %d thread(s)", nthreads, threads)
    set_num_threads.__doc__ = f"trainfast doctor --verify: ignored while the fix pins {threads} thread(s)"
    original(threads)
    stack.enter_context(mock.patch.object(torch, "set_num_threads", set_num_threads))


def _autocast_off(stack: ExitStack) -> None:
    """Every autocast the script enters runs disabled (float32): `torch.autocast`, and the per-device classes
    derived from it, are made with enabled=False."""
    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def disabled(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(original).bind(self, *args, **kwargs)
        bound.arguments["enabled"] = False
        original(*bound.args, **bound.kwargs)
    stack.enter_context(mock.patch.object(cls, "__init__", disabled))


class Injected:
    """What happened to the fixes while `apply_overrides` was active, in words (`events`): the model it found, a
    compile that fell back to eager and why. Read it after the script ran."""

    def __init__(self) -> None:
        self.events: list[str] = []


@contextmanager
def apply_overrides(overrides: Mapping[str, Any]) -> Iterator[Injected]:
    """While active: every DataLoader constructed takes the loader overrides, torch runs with `threads`
    intra-op threads (the script's own torch.set_num_threads calls are ignored), cudnn.benchmark and TF32 as
    given, and autocast off where `autocast` is false. Everything is put back on exit, also on an exception.
    Unknown keys raise ValueError."""
    checked = check_overrides(overrides)
    with ExitStack() as stack:
        stack.enter_context(torch_settings())  # puts back the thread count, cudnn.benchmark and TF32
        loader = {k: v for k, v in checked.items() if k in LOADER_KEYS}
        if loader:
            _patch_loader(stack, loader)
        if "threads" in checked:
            _pin_threads(stack, checked["threads"])
        if "cudnn_benchmark" in checked:
            torch.backends.cudnn.benchmark = checked["cudnn_benchmark"]
        if "tf32" in checked:
            set_tf32(checked["tf32"])  # either API, as the user's settings read (torch >= 2.9 has two)
        if checked.get("autocast") is False:
            _autocast_off(stack)
        yield Injected()
