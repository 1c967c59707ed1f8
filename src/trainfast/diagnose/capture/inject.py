"""What `trainfast doctor --verify` injects into the unmodified script to measure a fix, and `trainfast run --apply`
to keep it: DataLoader arguments, intra-op threads, cudnn.benchmark, TF32, the script's autocast off; the trained
model's layout, bf16 autocast, compile and evaluation precision (capture/inject_model.py); checkpoints written in the
background (capture/inject_save.py)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
from torch.utils.data import DataLoader

from trainfast.diagnose.capture.inject_model import Injected, ModelFixes, checked_dtype
from trainfast.diagnose.capture.inject_save import BackgroundSaves
from trainfast.trainer.settings import set_tf32, torch_settings

log = logging.getLogger("trainfast.diagnose")


LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


SETTING_KEYS = ("threads", "cudnn_benchmark", "tf32", "autocast")


MODEL_KEYS = ("memory_format", "compile", "eval_autocast", "async_checkpoint")


VALID_KEYS = LOADER_KEYS + SETTING_KEYS + MODEL_KEYS


LAYOUTS = ("channels_last", "contiguous")


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
        elif key == "memory_format":
            if value not in LAYOUTS:
                raise ValueError(f"override memory_format={value!r}: give one of {', '.join(LAYOUTS)}")
        elif key == "eval_autocast":
            checked_dtype(key, value)
        elif key == "autocast" and not isinstance(value, bool):
            if value != "bfloat16":
                raise ValueError(f"override autocast={value!r}: give false (the script's autocast off) or 'bfloat16' "
                                 "(its model's training forwards under bf16 autocast; float16 needs a GradScaler "
                                 "around the script's own backward and step, which cannot be injected)")
        elif not isinstance(value, bool):
            raise ValueError(f"override {key}={value!r}: give true or false")
        elif key == "autocast" and value:
            raise ValueError("override autocast=true: give false (the script's autocast off) or 'bfloat16'")
    return result


def merge_overrides(fixes: Sequence[tuple[str, Mapping[str, Any]]]) -> tuple[dict[str, Any], list[str]]:
    """Several fixes' overrides as one (the set a user would apply), in the order given (the report's rank): where
    two set one key differently, the first wins, and a line says which fix's value was dropped."""
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    dropped: list[str] = []
    for fix_id, overrides in fixes:
        for key, value in overrides.items():
            if key not in merged:
                merged[key], owner[key] = value, fix_id
            elif merged[key] != value or type(merged[key]) is not type(value):  # (True is 1, but not here)
                dropped.append(f"{fix_id}'s {key}={value!r} left out: {owner[key]}, ranked above it, sets "
                               f"{key}={merged[key]!r}")
    return merged, dropped


def needs_model(overrides: Mapping[str, Any]) -> bool:
    """Do the overrides act on the trained model (found at its first training forward: inject_model.py)?"""
    return any(key in overrides for key in ("memory_format", "compile", "eval_autocast")) or isinstance(
        overrides.get("autocast"), str)


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


@contextmanager
def apply_overrides(overrides: Mapping[str, Any]) -> Iterator[Injected]:
    """While active: every DataLoader constructed takes the loader overrides, torch runs with `threads`
    intra-op threads (the script's own torch.set_num_threads calls are ignored), cudnn.benchmark and TF32 as
    given, and autocast off where `autocast` is false; the trained model in `memory_format`, its training forwards
    under bf16 autocast (`autocast="bfloat16"`), compiled (`compile`), its evaluation forwards under inference_mode and
    `eval_autocast`; `torch.save` to a path written in the background (`async_checkpoint`). Everything is put back on
    exit, also on an exception. Unknown keys raise ValueError."""
    checked = check_overrides(overrides)
    injected = Injected()
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
        if checked.get("async_checkpoint"):
            BackgroundSaves(injected.events).install(stack)
        ModelFixes(checked, injected).install(stack)
        yield injected
