"""The tuned loader settings: `WorkerSettings`, and the cache `trainfast tune` writes and `workers="tuned"` reads.

One JSON file per (dataset, batch size, step, device, hardware) under $TRAINFAST_CACHE/tune, named by a digest of
those parts. The tuner (`trainfast.tune`) writes its whole result there with `save`; `make_loader` only needs
the record's `chosen` configuration (`load`). This module imports nothing from the tuner: the tuner builds its
trial loaders with `make_loader`, so the settings come down to the loader, never the other way.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainfast.atomic import write_json
from trainfast.cache import cache_root
from trainfast.host import available_cpus
from trainfast.loader.options import is_int

log = logging.getLogger("trainfast")
FORMAT = 2  # bump when the meaning of a cached result changes (2: the choice was confirmed against "auto")
T = TypeVar("T")


@dataclass(frozen=True, order=True)
class WorkerSettings:
    """What the tuner varies. Ordered cheapest first for a CPU target: fewer workers, fewer prefetched batches, no
    pinning (on CUDA pinning is the default and costs nothing: `trainfast.tune.search.cheapest_within(cuda=True)`).
    `backend`: what the workers are, "processes" or "threads" (`make_loader(backend=...)`)."""

    num_workers: int
    prefetch_factor: int | None = None
    pin_memory: bool = False
    cpu_threads: int | None = None  # intra-op threads while training on the CPU; None leaves torch's setting
    backend: str = "processes"

    def label(self) -> str:
        parts = [f"{'thread-workers' if self.backend == 'threads' else 'workers'}={self.num_workers}"]
        if self.num_workers:
            parts.append(f"prefetch={self.prefetch_factor}")
        if self.pin_memory:
            parts.append("pinned")
        if self.cpu_threads is not None:
            parts.append(f"threads={self.cpu_threads}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerSettings:
        """The configuration `to_json` wrote; ValueError when a field has the wrong type or range (a record
        edited or damaged by hand), so that a bad file is skipped instead of reaching the DataLoader."""
        config = cls(**{k: data[k] for k in ("num_workers", "prefetch_factor", "pin_memory", "cpu_threads")},
                     backend=data.get("backend", "processes"))  # records written before the backend was tuned
        if not (is_int(config.num_workers, 0) and (config.prefetch_factor is None or is_int(config.prefetch_factor, 1))
                and isinstance(config.pin_memory, bool)
                and (config.cpu_threads is None or is_int(config.cpu_threads, 1))
                and config.backend in ("processes", "threads")):
            raise ValueError(f"not a loader configuration: {data!r}")
        return config


def for_share(settings: WorkerSettings, *, machine_cpus: int, share_cpus: int) -> WorkerSettings:
    """`settings`, tuned for one process owning all `machine_cpus`, scaled to a process that owns `share_cpus` of
    them (torchrun: LOCAL_WORLD_SIZE processes on the machine). Workers and intra-op threads take the same share,
    rounded down, since every process beyond the cores slows all of them; but at least one of each that the tuning
    had: it measured workers faster than none. Prefetch, pinning and the backend are per worker: kept."""
    if share_cpus >= machine_cpus:
        return settings

    def scaled(n: int) -> int:
        return max(1, n * share_cpus // machine_cpus) if n > 0 else 0

    threads = None if settings.cpu_threads is None else scaled(settings.cpu_threads)
    return replace(settings, num_workers=scaled(settings.num_workers), cpu_threads=threads)


def dataset_fingerprint(dataset: Any) -> str:
    """What identifies a dataset across runs: its type, length, and root folder or tensor shapes; for image
    datasets the options that change a sample's cost, and a packed folder's pack settings."""
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return "tensors:" + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in dataset)
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple):
        return "TensorDataset:" + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    root = getattr(dataset, "root", None)
    extra = ":".join(str(getattr(dataset, a)) for a in ("image_size", "train", "decode") if hasattr(dataset, a))
    settings = getattr(dataset, "settings", None)  # how a packed folder was made: a re-pack is another dataset
    if isinstance(settings, dict):
        extra += ":" + json.dumps(settings, sort_keys=True, default=str)
    where = root if isinstance(root, str) and "://" in root else Path(root).resolve() if root else ""  # URL as given
    return f"{kind}:{len(dataset)}:{where}:{extra}"


def hardware_signature() -> str:
    gpus = ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else "cpu"
    return f"cpus={available_cpus()};gpus={gpus};torch={torch.__version__}"


def cache_key(dataset: Any, batch_size: int, *, with_step: bool, device: str) -> tuple[str, dict[str, Any]]:
    """The file name's digest, and what it was made from (kept in the file, for people)."""
    describes = {"dataset": dataset_fingerprint(dataset), "batch_size": batch_size, "with_step": with_step,
                 "device": device, "hardware": hardware_signature(), "format": FORMAT}
    digest = hashlib.sha256(json.dumps(describes, sort_keys=True).encode()).hexdigest()[:20]
    return digest, describes


def cache_path(key: str) -> Path:
    return cache_root() / "tune" / f"{key}.json"


def save(key: str, record: dict[str, Any]) -> Path:
    """Write a tuning record (`TuneResult.to_json()`: at least `chosen`) under `key`, atomically."""
    return write_json(cache_path(key), record)


def read(dataset: Any, batch_size: int, *, device: str, parse: Callable[[dict[str, Any]], T]) -> T | None:
    """`parse` of the cached record for this dataset and batch size on this machine: the one tuned with a
    training step if there is one, else of the loader alone; None when it was never tuned. An unreadable
    record is skipped with a warning."""
    for with_step in (True, False):
        key, _ = cache_key(dataset, batch_size, with_step=with_step, device=device)
        path = cache_path(key)
        if path.is_file():
            try:
                return parse(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("ignoring unreadable tuning result %s (%s); run trainfast tune again", path, e)
    return None


def load(dataset: Any, batch_size: int, *, device: str) -> WorkerSettings | None:
    """The configuration `trainfast tune` chose for this dataset and batch size on this machine, if any."""
    return read(dataset, batch_size, device=device, parse=lambda record: WorkerSettings.from_json(record["chosen"]))
