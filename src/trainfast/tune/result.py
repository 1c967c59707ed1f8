"""`TuneResult`, and its cache: one JSON file per (dataset, batch size, step, hardware) under $TRAINFAST_CACHE/tune."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainfast.atomic import write_json
from trainfast.data.synthetic import cache_root
from trainfast.loader.cpus import available_cpus
from trainfast.tune.trial import LoaderConfig, Trial

log = logging.getLogger("trainfast")
FORMAT = 1  # bump when the meaning of a cached result changes


@dataclass
class TuneResult:
    chosen: LoaderConfig
    chosen_samples_per_s: float
    baseline: LoaderConfig
    baseline_samples_per_s: float
    trials: list[Trial]
    sweep_seconds: float
    key: str
    describes: dict[str, Any] = field(default_factory=dict)  # what the key was made from, for people

    @property
    def speedup(self) -> float:
        return self.chosen_samples_per_s / self.baseline_samples_per_s if self.baseline_samples_per_s else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_json(), "chosen_samples_per_s": self.chosen_samples_per_s,
                "baseline": self.baseline.to_json(), "baseline_samples_per_s": self.baseline_samples_per_s,
                "speedup": self.speedup, "trials": [t.to_json() for t in self.trials],
                "sweep_seconds": self.sweep_seconds, "key": self.key, "describes": self.describes, "format": FORMAT}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TuneResult:
        trials = [Trial(LoaderConfig.from_json(t["config"]), t["samples_per_s"], t["seconds"]) for t in data["trials"]]
        return cls(LoaderConfig.from_json(data["chosen"]), data["chosen_samples_per_s"],
                   LoaderConfig.from_json(data["baseline"]), data["baseline_samples_per_s"], trials,
                   data["sweep_seconds"], data["key"], data.get("describes", {}))


def dataset_fingerprint(dataset: Any) -> str:
    """What identifies a dataset across runs: its type, length, and root folder or tensor shapes."""
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return "tensors:" + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in dataset)
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple):
        return "TensorDataset:" + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    root = getattr(dataset, "root", None)
    extra = ":".join(str(getattr(dataset, a)) for a in ("image_size", "train", "decode") if hasattr(dataset, a))
    return f"{kind}:{len(dataset)}:{Path(root).resolve() if root else ''}:{extra}"


def hardware_signature() -> str:
    gpus = ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else "cpu"
    return f"cpus={available_cpus()};gpus={gpus};torch={torch.__version__}"


def cache_key(dataset: Any, batch_size: int, *, with_step: bool, device: str) -> tuple[str, dict[str, Any]]:
    describes = {"dataset": dataset_fingerprint(dataset), "batch_size": batch_size, "with_step": with_step,
                 "device": device, "hardware": hardware_signature(), "format": FORMAT}
    digest = hashlib.sha256(json.dumps(describes, sort_keys=True).encode()).hexdigest()[:20]
    return digest, describes


def cache_path(key: str) -> Path:
    return cache_root() / "tune" / f"{key}.json"


def save(result: TuneResult) -> Path:
    return write_json(cache_path(result.key), result.to_json())


def load(dataset: Any, batch_size: int, *, device: str) -> TuneResult | None:
    """The cached result for this dataset and batch size on this machine: with a training step if there is
    one, else of the loader alone; None when it was never tuned (or the cache is unreadable)."""
    for with_step in (True, False):
        key, _ = cache_key(dataset, batch_size, with_step=with_step, device=device)
        path = cache_path(key)
        if path.is_file():
            try:
                return TuneResult.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("ignoring unreadable tuning result %s (%s); run trainfast tune again", path, e)
    return None
