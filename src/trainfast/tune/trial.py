"""One tuning trial: a loader configuration measured at steady state, co-running the training step if given.

A trial may stop early. Batch times are noisy (a block of two batches varies by 6-11 % here), so the rate's
uncertainty is estimated from blocks of batches (a block spans the workers' round, whose batches arrive in bursts):
the trial stops once the 95 % confidence interval of the mean block time is within `precision` of it (Student's t:
a few blocks give a wide interval however alike they look), or once the rate is below `beat`, the rate it would
have to reach to matter to the search, by more than that interval.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from trainfast.device import DeviceClock
from trainfast.loader.make import make_loader
from trainfast.loader.options import Backend
from trainfast.loader.tuned import WorkerSettings as WorkerSettings  # re-exported: what a trial measures
from trainfast.samples import batch_samples
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.step import TrainStep

MIN_BLOCKS = 4  # fewer blocks say next to nothing about the spread
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26)  # Student's t, 97.5th percentile, 1-9 degrees of freedom


def t95(df: int) -> float:
    """Student's t 97.5th percentile (two-sided 95 %) for `df` >= 1 degrees of freedom, within 1 % past the table."""
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.5 / df


@dataclass(frozen=True)
class Trial:
    config: WorkerSettings
    samples_per_s: float
    seconds: float  # wall time the trial took, start-up included
    batches: int = 0  # batches measured (after warm-up); 0 in records written before trials could stop early

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_json(), "samples_per_s": self.samples_per_s, "seconds": self.seconds,
                "batches": self.batches}


def uncertainty(marks: Sequence[float], block: int) -> float | None:
    """Half-width of the 95 % confidence interval of the mean time of `block` consecutive batches, relative to that
    mean, from the times `marks` at which measured batches were done (`marks[0]`: the clock's start); None while
    fewer than `MIN_BLOCKS` blocks."""
    blocks = (len(marks) - 1) // block
    if blocks < MIN_BLOCKS:
        return None
    times = [marks[(j + 1) * block] - marks[j * block] for j in range(blocks)]
    mean = statistics.fmean(times)
    return t95(blocks - 1) * statistics.stdev(times) / math.sqrt(blocks) / mean if mean > 0 else 0.0


def run_trial(dataset: Any, batch_size: int, config: WorkerSettings, *, step_fn: TrainStep | None, batches: int,
              warmup: int, device: str = "auto", precision: float | None = None, beat: float | None = None,
              max_s: float | None = None) -> Trial:
    """Samples/s over `batches` batches after `warmup` (worker start-up, first-batch effects excluded).

    With `precision`, `beat` or `max_s`, `batches` is a cap: the trial stops once its rate is known within
    `precision` (95 % confidence), once it is clearly below `beat` samples/s, or after `max_s` measured
    seconds, whichever comes first (each after at least `MIN_BLOCKS` blocks). The device is synchronised before
    the clock starts and before it stops (`device` names it, "auto" as `resolve_device` resolves it): otherwise
    queued warm-up work is booked to the measured batches.
    """
    started = time.perf_counter()
    loader = make_loader(dataset, batch_size, shuffle=True, workers=config.num_workers,
                         prefetch_factor=config.prefetch_factor or "auto", pin_memory=config.pin_memory,
                         persistent_workers=True, device=device, seed=0, backend=cast(Backend, config.backend))
    samples, clock, marks = 0, DeviceClock(device), list[float]()
    block, early = max(2, config.num_workers), precision is not None or beat is not None or max_s is not None

    def settled() -> bool:
        error = uncertainty(marks, block)
        if error is None:
            return False
        rate = samples / (marks[-1] - marks[0]) if marks[-1] > marks[0] else math.inf
        return ((precision is not None and error <= precision) or (beat is not None and rate * (1 + error) < beat)
                or (max_s is not None and marks[-1] - marks[0] >= max_s))

    try:
        with torch_settings(cpu_threads=config.cpu_threads):
            seen = 0
            if warmup == 0:
                clock.start()
                marks += [time.perf_counter()] if early else []
            while seen < warmup + batches:
                fetched = 0
                for batch in loader:  # a short dataset is cycled: a measurement needs enough batches
                    fetched += 1
                    if step_fn is not None:
                        step_fn(batch)
                    seen += 1
                    if seen == warmup:
                        clock.start()
                        marks += [time.perf_counter()] if early else []
                    elif seen > warmup:
                        samples += batch_samples(batch)
                        if early:
                            marks.append(time.perf_counter())
                            if settled():
                                batches = seen - warmup
                    if seen >= warmup + batches:
                        break
                if fetched == 0:
                    raise ValueError("the dataset yields no batch at this batch size; lower batch_size")
            elapsed = clock.elapsed()
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return Trial(config, samples / elapsed if elapsed > 0 else 0.0, time.perf_counter() - started, seen - warmup)
