"""`Series`: what a `Monitor` sampled, frozen: every metric's (times, values), when sampling started, what could
not be sampled, and which NVML GPU each CUDA device is. The monitor's read API (`metrics`, `series`, `summary`,
`gpu_sawtooth`, `nvml_index`) on data that no longer changes and goes to JSON and back exactly: the doctor keeps it
in its capture of a run (diagnose/records/capture.py), and its analyses read it as they read a live Monitor."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainfast.monitor.analysis import Stats, detect_sawtooth, stats

_GPU_UTIL = re.compile(r"gpu\d+\.util")


@dataclass(frozen=True)
class Series:
    started_at: float | None  # time.monotonic() when sampling started: the series' times are seconds since then
    by_metric: Mapping[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    unavailable: Mapping[str, str] = field(default_factory=dict)  # {source: why it could not be sampled}
    nvml: Mapping[int, int | None] = field(default_factory=dict)  # torch's cuda:{i} -> NVML index (gpu{j}.*)

    def metrics(self) -> list[str]:
        """The names of every metric sampled, sorted."""
        return sorted(self.by_metric)

    def series(self, metric: str) -> tuple[list[float], list[float]]:
        """(seconds since start, values) of one metric, for the samples that have it."""
        found = self.by_metric.get(metric)
        if found is None:
            raise KeyError(f"no samples of {metric!r}; metrics recorded: {self.metrics()}")
        return found

    def summary(self) -> dict[str, Stats]:
        """`Stats` of every metric, by metric name (sorted)."""
        return {metric: stats(values) for metric, (_, values) in sorted(self.by_metric.items())}

    def gpu_sawtooth(self) -> dict[str, bool]:
        """For each `gpu{i}.util`: does it swing between idle and busy (an input-bound run)?"""
        return {metric: detect_sawtooth(values) for metric, (_, values) in sorted(self.by_metric.items())
                if _GPU_UTIL.fullmatch(metric)}

    def nvml_index(self, cuda_index: int) -> int | None:
        """The NVML index of torch's `cuda:{cuda_index}`, as the monitor matched it; None when it could not."""
        return self.nvml.get(cuda_index)

    def to_json(self) -> dict[str, Any]:
        return {"started_at": self.started_at,
                "series": {m: [list(t), list(v)] for m, (t, v) in self.by_metric.items()},
                "unavailable": dict(self.unavailable), "nvml": {str(k): v for k, v in self.nvml.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Series:
        return cls(started_at=data["started_at"],
                   by_metric={m: (list(t), list(v)) for m, (t, v) in data["series"].items()},
                   unavailable=dict(data["unavailable"]), nvml={int(k): v for k, v in data["nvml"].items()})


def cuda_indices(metrics: list[str]) -> set[int]:
    """The CUDA devices this process's allocator was sampled on (`cuda{i}.*` metrics)."""
    return {int(m[4:].partition(".")[0]) for m in metrics if m.startswith("cuda") and m[4:].partition(".")[0].isdigit()}
