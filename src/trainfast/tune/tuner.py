"""`tune_loader`: measure loader configurations on this machine and remember the cheapest fast one."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainfast.atomic import as_write_failure
from trainfast.device import DeviceClock
from trainfast.host import available_cpus
from trainfast.loader.auto import batches_in_flight, threads_beside_workers
from trainfast.loader.make import make_loader
from trainfast.loader.options import LoaderOptions
from trainfast.loader.resolve import resolve_loader
from trainfast.loader.tuned import WorkerSettings, cache_key, cache_path
from trainfast.samples import batch_samples
from trainfast.trainer.step import TrainStep
from trainfast.tune import result as cache
from trainfast.tune.confirm import ROUNDS, confirm
from trainfast.tune.result import TuneResult
from trainfast.tune.search import cheapest_within, search
from trainfast.tune.trial import Trial, run_trial

log = logging.getLogger("trainfast")
progress = logging.getLogger("trainfast.tune")  # stays audible while make_loader's explanations are muted
TRIAL_SHARE = 1 / 8  # each trial gets at most about this share of the budget: the search runs 5-9 of them
MAX_BATCHES = 400
# A trial stops once its rate is known within this (95 % confidence): finer than the 5 % the choice may miss the
# exhaustive sweep's best by, coarser would let the noise decide.
PRECISION = 0.04
# The confirmation against "auto" (`trainfast.tune.confirm`) is held to about this share of the budget: at most
# 2 x ROUNDS runs of a few seconds each (it stops sooner once decided).
CONFIRM_SHARE = 0.2


@contextmanager
def _quiet() -> Iterator[None]:
    """make_loader explains every plan at INFO; during a sweep that is dozens of lines. The tuner's own
    lines go on at the level the application chose."""
    level, own = log.getEffectiveLevel(), progress.level
    log.setLevel(max(level, logging.WARNING))
    progress.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(level)
        progress.setLevel(own)


def _compute_rate(dataset: Any, batch_size: int, step_fn: TrainStep, repeats: int = 10, *,
                  device: str = "auto") -> float:
    """Samples/s of the training step alone, replaying one cached batch: the most any loader could feed."""
    batch = next(iter(make_loader(dataset, batch_size, workers=0, shuffle=False, device=device)))
    step_fn(batch)  # warm-up
    clock = DeviceClock(device)
    clock.start()  # the warm-up step's kernels are not the measured steps'
    for _ in range(repeats):
        step_fn(batch)
    return repeats * batch_samples(batch) / clock.elapsed()


def start_config(dataset: Any, batch_size: int, *, device: str, cpu_training: bool) -> WorkerSettings:
    """`make_loader`'s "auto" plan for this dataset as a configuration: where the search starts."""
    plan = resolve_loader(dataset, batch_size, LoaderOptions(device=device)).plan
    busy = plan.loader_cores if plan.loader_cores is not None else plan.num_workers  # threads waiting on reads: fewer
    return WorkerSettings(plan.num_workers, plan.prefetch_factor, plan.pin_memory,
                          threads_beside_workers(available_cpus(), busy) if cpu_training else None, plan.backend)


def tune_loader(dataset: Any, batch_size: int, step_fn: TrainStep | None = None, *, budget_s: float = 60.0,
                device: str = "auto", save: bool = True, batches: int | None = None) -> TuneResult:
    """Find the cheapest loader configuration within a few percent of the fastest, by measurement.

    With `step_fn(batch)` (one training step), trials co-run it: a loader measured alone cannot see that
    its workers take cores from the model. On the CPU the intra-op thread count is tuned with the workers.
    The search's choice is then run against `make_loader`'s "auto" plan in interleaved rounds and kept only when
    it is at least 3 % faster (`trainfast.tune.confirm`); otherwise "auto" is kept, and the result says why.
    The result is cached for `make_loader(dataset, batch_size, workers="tuned")` and the Trainer.
    A trial measures until its rate is known within `PRECISION`, or is clearly too slow to matter, for at most
    `batches` batches (default `MAX_BATCHES`) and about `budget_s / 8` seconds.
    """
    if budget_s <= 0:
        raise ValueError(f"budget_s={budget_s} is not valid; give the search a positive number of seconds")
    target = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device.split(":")[0]
    cpus = available_cpus()
    cpu_training = step_fn is not None and target == "cpu"
    started = time.perf_counter()
    with _quiet():
        compute_rate = _compute_rate(dataset, batch_size, step_fn, device=device) if step_fn is not None else None
        cap = batches if batches is not None else MAX_BATCHES

        def measure(config: WorkerSettings, beat: float | None) -> Trial:
            trial = run_trial(dataset, batch_size, config, step_fn=step_fn, batches=cap, warmup=_past_queues(config),
                              device=device, precision=PRECISION, beat=beat, max_s=budget_s * TRIAL_SHARE)
            progress.info("tune: %-48s %9.0f samples/s (%d batches, %.1f s)", config.label(), trial.samples_per_s,
                          trial.batches, trial.seconds)
            return trial

        start = start_config(dataset, batch_size, device=device, cpu_training=cpu_training)
        remaining = budget_s * (1 - CONFIRM_SHARE) - (time.perf_counter() - started)
        trials = search(measure, start=start, cpus=cpus, cpu_training=cpu_training, cuda=target == "cuda",
                        budget_s=max(remaining, 0.0), compute_rate=compute_rate,
                        threads_backend=not _in_memory(dataset))
        searched = time.perf_counter() - started
        best = cheapest_within(trials, cuda=target == "cuda", cpus=cpus if cpu_training else None)
        confirmation = None
        if best.config != start:
            per_run = max(1.0, budget_s * CONFIRM_SHARE / (2 * ROUNDS))

            def run(config: WorkerSettings) -> Trial:
                trial = run_trial(dataset, batch_size, config, step_fn=step_fn, batches=cap,
                                  warmup=_past_queues(config), device=device,
                                  max_s=per_run)
                progress.info("tune: confirm %-40s %9.0f samples/s", config.label(), trial.samples_per_s)
                return trial
            confirmation = confirm(run, best.config, start)
            progress.info("tune: %s", confirmation.reason())
    baseline = next(t for t in trials if t.config == WorkerSettings(0))
    chosen = best if confirmation is None or confirmation.keeps_tuned else next(t for t in trials if t.config == start)
    key, describes = cache_key(dataset, batch_size, with_step=step_fn is not None, device=target)
    describes["compute_only_samples_per_s"] = compute_rate
    result = TuneResult(chosen.config, chosen.samples_per_s, baseline.config, baseline.samples_per_s, trials,
                        time.perf_counter() - started, key, describes, auto=start, confirmation=confirmation,
                        search_seconds=searched)
    if save:
        _cache(result)
    return result


def _past_queues(config: WorkerSettings) -> int:
    """A trial's warm-up: 2 batches past the queues its workers fill first."""
    return 2 + batches_in_flight(config.num_workers, config.prefetch_factor)


def _cache(result: TuneResult) -> None:
    """Save the result where `workers="tuned"` finds it; a cache that cannot be written (a full volume, no
    permission) costs only the cache: the result is still returned (and printed by `trainfast tune`)."""
    try:
        path = cache.save(result)
    except Exception as e:
        failure = as_write_failure(e)
        log.warning("tune: could not cache the choice in %s (%s): workers=\"tuned\" will not find it. Free space "
                    "there, or set TRAINFAST_CACHE to a writable folder, and tune again", cache_path(result.key),
                    failure)
        return
    log.info("tune: chose %s (%.0f samples/s, %.2fx the baseline); saved %s", result.chosen.label(),
             result.chosen_samples_per_s, result.speedup, path)


def _in_memory(dataset: Any) -> bool:
    """Tensors batched in place by indexing: no decode for loader threads to overlap."""
    return resolve_loader(dataset, 1, LoaderOptions(device="cpu", workers=0)).tensors is not None
