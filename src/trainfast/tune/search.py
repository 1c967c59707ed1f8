"""The tuner's search: adaptive and budgeted, never the full grid.

1. The baseline: the tutorials' "before" (no workers, no pinning, torch's default threads).
2. Workers: grow one at a time (from none, on CUDA) while throughput still rises by more than `GAIN` or until
   it meets the training step's own rate (measured alone on one cached batch); when training on the CPU each
   worker count is paired with the intra-op threads left beside it, and one more thread split is tried.
   With a CUDA target every configuration pins memory, as `make_loader`'s "auto" does there.
3. Around the best worker count: a deeper prefetch queue, and on CUDA the same without pinning.
4. The choice: the *cheapest* configuration within `TOLERANCE` of the best one measured: spare cores and
   memory are worth more than a difference smaller than the measurement noise. Pinning counts as a cost
   only when the target is the CPU; on CUDA it is the expected setting and wins ties.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from trainfast.loader.tuned import WorkerSettings
from trainfast.tune.trial import Trial

# A worker that adds less than this is not worth its core and memory (the noise between runs here is ~3 %).
GAIN = 0.05
# Configurations within this of the best are equivalent; the cheapest of them is chosen.
TOLERANCE = 0.03


def cheapest_within(trials: Iterable[Trial], tolerance: float = TOLERANCE, *, cuda: bool = False) -> Trial:
    """The cheapest trial (fewest workers, then prefetch, pinning, threads) within `tolerance` of the best.

    With `cuda`, unpinned memory is the "cost" instead: pinning is what a GPU target runs with by default,
    and its win (asynchronous copies) is easily within the noise of a short loader trial.
    """
    trials = list(trials)
    if not trials:
        raise ValueError("no trial to choose from")
    best = max(t.samples_per_s for t in trials)
    good = [t for t in trials if t.samples_per_s >= (1 - tolerance) * best]
    return min(good, key=lambda t: (t.config.num_workers, t.config.prefetch_factor or 0,
                                    t.config.pin_memory != cuda, -(t.config.cpu_threads or 0)))


def threads_for(cpus: int, workers: int) -> int:
    """Intra-op threads beside `workers` loader processes on `cpus` cores (at least one)."""
    return max(1, cpus - workers)


def search(measure: Callable[[WorkerSettings], Trial], *, cpus: int, cpu_training: bool, cuda: bool,
           budget_s: float, compute_rate: float | None = None, max_workers: int | None = None) -> list[Trial]:
    """Run the trials `measure` makes, in the order above, until done or `budget_s` is spent."""
    started = time.perf_counter()
    trials: list[Trial] = []
    seen: set[WorkerSettings] = set()

    def trial(config: WorkerSettings) -> Trial | None:
        if config in seen or (trials and time.perf_counter() - started > budget_s):  # the baseline always runs
            return None
        seen.add(config)
        result = measure(config)
        trials.append(result)
        return result

    def worker_config(workers: int) -> WorkerSettings:
        return WorkerSettings(num_workers=workers, prefetch_factor=2 if workers else None, pin_memory=cuda,
                            cpu_threads=threads_for(cpus, workers) if cpu_training else None)

    baseline = trial(WorkerSettings(num_workers=0))
    assert baseline is not None  # the first trial always runs
    limit = max_workers if max_workers is not None else (cpus if cpu_training else max(1, cpus - 1))
    # On CUDA the worker counts are compared pinned, from none: the unpinned baseline is the tutorials' "before",
    # not a step of this series.
    best = (trial(worker_config(0)) if cuda else None) or baseline
    for workers in range(1, limit + 1):
        result = trial(worker_config(workers))
        if result is None:
            continue
        if result.samples_per_s > best.samples_per_s * (1 + GAIN):
            best = result
        elif workers > 0 and result.samples_per_s <= best.samples_per_s * (1 + GAIN):
            break  # one more worker bought nothing
        if compute_rate is not None and best.samples_per_s >= (1 - TOLERANCE) * compute_rate:
            break  # the loader keeps up with the step: more workers cannot help
    top = max(trials, key=lambda t: t.samples_per_s).config
    if cpu_training and top.num_workers and top.cpu_threads is not None:  # the other side of the core split
        trial(replace(top, cpu_threads=top.cpu_threads + 1))
        if top.cpu_threads > 1:
            trial(replace(top, cpu_threads=top.cpu_threads - 1))
    top = max(trials, key=lambda t: t.samples_per_s).config
    if top.num_workers:
        trial(replace(top, prefetch_factor=4))
    if cuda:  # the alternative to the default; with no workers it is the baseline, already measured
        trial(replace(top, pin_memory=False))
    return trials
