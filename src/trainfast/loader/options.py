"""`LoaderOptions`: every `make_loader` setting, validated once; CLI flags can be generated from it
(`add_config_flags(parser, LoaderOptions)`, as for `TrainConfig`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from trainfast.device import device_kind
from trainfast.loader.auto import Auto
from trainfast.loader.prefetch import Normalize

Tuned = Literal["tuned"]
Backend = Literal["auto", "processes", "threads"]
BACKENDS = ("auto", "processes", "threads")


def _opt(help: str, **extra: Any) -> dict[str, Any]:
    return {"help": help, **extra}


def check_choice(name: str, value: Any, ok: bool, valid: str) -> None:
    """ValueError naming the setting, its value and the valid choices, unless `ok`."""
    if not ok:
        raise ValueError(f"{name}={value!r} is not valid; use {valid}")


def is_int(value: Any, minimum: int) -> bool:
    """An int (not a bool) >= `minimum`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# The workers setting, for `make_loader(workers=)`, `LoaderOptions` and every command's `--workers` alike
WORKER_WORDS = ("auto", "tuned")
WORKERS_VALID = "'auto', 'tuned' or an integer >= 0 (0 loads in the main process)"


def is_workers(value: Any) -> bool:
    """A valid workers setting: "auto", "tuned" or an int (not a bool) >= 0."""
    return value in WORKER_WORDS or is_int(value, 0)


def check_workers(value: Any) -> None:
    """ValueError `workers=<value> is not valid; use <the choices>` unless `value` is a workers setting."""
    check_choice("workers", value, is_workers(value), WORKERS_VALID)


def parse_workers(text: str) -> int | Auto | Tuned:
    """A workers setting written as text (a command line's `--workers`): "auto", "tuned" or the integer it spells;
    ValueError `'<text>' is not valid; use <the choices>` otherwise."""
    if text == "auto":
        return "auto"
    if text == "tuned":
        return "tuned"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not is_workers(value):
        raise ValueError(f"{text!r} is not valid; use {WORKERS_VALID}")
    return value


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """How `make_loader` should load: "auto" settings are resolved later, against the data and this machine.

    Invalid values raise ValueError here, naming the setting and the valid choices. `collate_fn` and
    `normalize` are objects, not command-line values: `add_config_flags` makes no flag for them (`flag=False`).
    """

    shuffle: bool = field(default=True, metadata=_opt(
        "shuffle the samples each epoch (the order depends only on the seed and the epoch)"))
    workers: int | Auto | Tuned = field(default="auto", metadata=_opt(
        "loader worker processes: N (0 loads in the main process), 'auto', or 'tuned' (`trainfast tune`'s result "
        "for this dataset and batch size, 'auto' without one)"))
    pin_memory: bool | Auto = field(default="auto", metadata=_opt(
        "page-locked host batches for faster copies to the GPU: true, false or 'auto' (when the target is CUDA)"))
    prefetch_factor: int | Auto = field(default="auto", metadata=_opt(
        "batches each worker loads ahead: N >= 1 or 'auto' (4 batches in flight, at least 2 per worker)"))
    persistent_workers: bool | Auto = field(default="auto", metadata=_opt(
        "keep the workers between epochs: true, false or 'auto' (whenever there are workers)"))
    drop_last: bool | Auto = field(default="auto", metadata=_opt(
        "drop the last incomplete batch: true, false or 'auto' (when shuffling: equal batch shapes every step)"))
    device: str | torch.device = field(default="auto", metadata=_opt(
        "where the batches go, which decides workers and pinning: 'auto', 'cpu', 'cuda' or 'cuda:N'"))
    seed: int = field(default=0, metadata=_opt("seed of the shuffle order and of each batch's augmentation RNGs"))
    collate_fn: Callable[[list[Any]], Any] | None = field(default=None, metadata=_opt(
        "turns a list of samples into a batch; none: torch's default_collate", flag=False))
    normalize: Normalize | None = field(default=None, metadata=_opt(
        "per-channel mean and std the prefetcher applies on the device; none: the dataset's `normalize`, if any",
        flag=False))
    rank: int | None = field(default=None, metadata=_opt(
        "this process's shard of each epoch; none: torchrun's RANK (0 without it)"))
    world_size: int | None = field(default=None, metadata=_opt(
        "processes sharing each epoch; none: torchrun's WORLD_SIZE (1 without it)"))
    multiprocessing_context: str | None = field(default=None, metadata=_opt(
        "how workers start: 'fork', 'spawn' or 'forkserver'; none: the platform's default"))
    timeout_s: float = field(default=0, metadata=_opt(
        "seconds to wait for each batch from a worker before raising LoaderError; 0 waits forever"))
    # `str`, validated below: cli/flags.py converts a Literal only inside a union (`int | Auto`), not alone
    backend: str = field(default="auto", metadata=_opt(
        "what the workers are: 'processes' (DataLoader worker processes), 'threads' (threads of this process "
        "making whole batches: no IPC, for decoders that release the GIL; augmentation is reproducible only when "
        "drawn from trainfast.loader.seeding.batch_rngs()) or 'auto' (processes, unless workers='auto' and a few "
        "timed reads wait on I/O more than they use the CPU: then a pool of threads sized to hide that latency)",
        choices=BACKENDS))

    def __post_init__(self) -> None:
        check_workers(self.workers)
        check_choice("prefetch_factor", self.prefetch_factor,
                     self.prefetch_factor == "auto" or is_int(self.prefetch_factor, 1), "'auto' or an integer >= 1")
        check_choice("backend", self.backend, self.backend in BACKENDS, "'auto', 'processes' or 'threads'")
        t = self.timeout_s
        check_choice("timeout_s", t, isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                     and t >= 0, "a number of seconds >= 0 (0 waits for each batch forever)")
        if not isinstance(self.device, torch.device):
            device_kind(self.device)  # ValueError naming the device and the valid forms
