"""The tuner's search: adaptive and budgeted, never the full grid.

1. The start: `make_loader`'s own "auto" plan for this machine (workers, prefetch, pinning, and on the CPU the
   intra-op threads beside the workers), then the baseline, the tutorials' "before" (no workers, no pinning,
   torch's default threads).
2. Workers from the start: one more while that gains more than `GAIN` and the loader does not yet keep up with the
   training step's own rate (measured alone on one cached batch); if none was added, halve them (down to none)
   while the rate stays within `WITHIN` of the best (3 %, `trainfast.decide`: configurations that close are
   equivalent, the noise between runs is as large; fewer workers are cheaper). Each count comes with auto's
   prefetch and, when training on the CPU, the intra-op threads left beside it.
3. Around the best: the other side of the CPU split (one thread more, one less), the threads backend (loader
   threads in place of processes), the other prefetch depth, and on CUDA the same without pinning.
4. The choice: the *cheapest* configuration within `WITHIN` of the best one measured: spare cores and
   memory are worth more than a difference smaller than the measurement noise. When training on the CPU, a
   configuration with more busy threads (workers + intra-op threads) than usable CPUs is costlier than any that
   fits: it is chosen only when it beats all of them by more than `WITHIN` (oversubscribed cores can train at
   half the speed of a short trial's reading). Pinning counts as a cost
   only when the target is the CPU; on CUDA it is the expected setting and wins ties. Worker processes win ties
   over threads: only they keep a dataset that draws from the global RNGs reproducible.

Every trial after the start stops as soon as it is clearly outside `WITHIN` of the best so far (`measure`'s
`beat`): most candidates lose, and a loser needs only enough batches to show it (the baseline too: its rate is
reported, from fewer batches, when it is clearly slower).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from trainfast.decide import WITHIN
from trainfast.loader.auto import auto_prefetch, threads_beside_workers
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune.trial import Trial

# A worker that adds less than this is not worth its core and memory (the noise between runs here is ~3 %).
GAIN = 0.05

Measure = Callable[[WorkerSettings, "float | None"], Trial]  # (config, beat: the rate that matters or None)


def oversubscribed(config: WorkerSettings, cpus: int) -> bool:
    """More busy threads than `cpus` while training on the CPU: every worker and every intra-op thread."""
    return config.cpu_threads is not None and config.num_workers + config.cpu_threads > cpus


def cheapest_within(trials: Iterable[Trial], tolerance: float = WITHIN, *, cuda: bool = False,
                    cpus: int | None = None) -> Trial:
    """The cheapest trial (within `cpus` busy threads, processes before threads, fewest workers, then prefetch,
    pinning, threads) within `tolerance` of the best.

    With `cuda`, unpinned memory is the "cost" instead: pinning is what a GPU target runs with by default,
    and its win (asynchronous copies) is easily within the noise of a short loader trial.
    """
    trials = list(trials)
    if not trials:
        raise ValueError("no trial to choose from")
    best = max(t.samples_per_s for t in trials)
    good = [t for t in trials if t.samples_per_s >= (1 - tolerance) * best]
    return min(good, key=lambda t: (cpus is not None and oversubscribed(t.config, cpus),
                                    t.config.backend != "processes", t.config.num_workers,
                                    t.config.prefetch_factor or 0, t.config.pin_memory != cuda,
                                    -(t.config.cpu_threads or 0)))


def search(measure: Measure, *, start: WorkerSettings, cpus: int, cpu_training: bool, cuda: bool, budget_s: float,
           compute_rate: float | None = None, max_workers: int | None = None,
           threads_backend: bool = True) -> list[Trial]:
    """Run the trials `measure` makes, in the order above, until done or `budget_s` is spent (the start and the
    baseline always run). `threads_backend=False` leaves the threads backend out."""
    started = time.perf_counter()
    trials: list[Trial] = []
    seen: set[WorkerSettings] = set()

    def best() -> Trial:
        return max(trials, key=lambda t: t.samples_per_s)

    def trial(config: WorkerSettings, always: bool = False) -> Trial | None:
        if config in seen or (not always and time.perf_counter() - started > budget_s):
            return None
        seen.add(config)
        result = measure(config, (1 - WITHIN) * best().samples_per_s if trials else None)
        trials.append(result)
        return result

    def with_workers(workers: int) -> WorkerSettings:
        return WorkerSettings(num_workers=workers, prefetch_factor=auto_prefetch(workers) if workers else None,
                              pin_memory=cuda,
                              cpu_threads=threads_beside_workers(cpus, workers) if cpu_training else None)

    def keeps_up(t: Trial) -> bool:  # the loader feeds the step as fast as it runs: more loading cannot help
        return compute_rate is not None and t.samples_per_s >= (1 - WITHIN) * compute_rate

    first = trial(start, always=True)
    assert first is not None  # the start always runs
    trial(WorkerSettings(num_workers=0), always=True)
    limit = max_workers if max_workers is not None else (cpus if cpu_training else max(1, cpus - 1))
    workers, grown = start.num_workers + 1, False
    while workers <= limit and not keeps_up(best()):
        before = best().samples_per_s
        result = trial(with_workers(workers))
        if result is None or result.samples_per_s <= before * (1 + GAIN):
            break  # one more worker bought nothing
        workers, grown = workers + 1, True
    workers = start.num_workers // 2
    while not grown and start.num_workers > 0:  # down to none: on CUDA, pinned batches from the main process
        result = trial(with_workers(workers))
        if workers == 0 or result is None or result.samples_per_s < (1 - WITHIN) * best().samples_per_s:
            break
        workers //= 2
    top = best().config
    if cpu_training and top.num_workers and top.cpu_threads is not None:  # the other side of the core split
        trial(replace(top, cpu_threads=top.cpu_threads + 1))
        if top.cpu_threads > 1:
            trial(replace(top, cpu_threads=top.cpu_threads - 1))
    top = best().config
    if top.num_workers:
        if threads_backend:
            trial(replace(top, backend="threads"))
        trial(replace(top, prefetch_factor=2 if (top.prefetch_factor or 2) > 2 else 4))
    if cuda:  # the alternative to the default; with no workers it is the baseline, already measured
        trial(replace(top, pin_memory=False))
    return trials
