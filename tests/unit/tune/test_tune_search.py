"""The tuner: its adaptive search on fake measurements, the cheapest-within-tolerance choice, the cache,
make_loader(workers="tuned"), and a real tuning run on tiny data."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

import helpers
from trainfast import make_loader
from trainfast.data.images import ImageFolder
from trainfast.loader import tuned as cache
from trainfast.loader.auto import auto_prefetch
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune import result as tune_result
from trainfast.tune.search import cheapest_within, search
from trainfast.tune.trial import Trial
from trainfast.tune.tuner import tune_loader

# Trials that measure nothing (see helpers.fake_measure); prefetch_factor 4 a hair faster: within noise, not worth
# the memory.
fake_measure = partial(helpers.fake_measure, prefetch_4=1.01)


def start(workers: int, *, cpus: int = 8, cuda: bool = False, cpu_training: bool = False) -> WorkerSettings:
    """What make_loader's "auto" plan gives the search as its start."""
    return WorkerSettings(workers, auto_prefetch(workers) if workers else None, cuda,
                          max(1, cpus - workers) if cpu_training else None)


@pytest.mark.parametrize(("rates", "first", "workers"), [
    ({0: 100, 1: 180, 2: 250, 3: 255, 4: 256}, 1, 2),   # up from 1: a third worker adds 2 %: stop, keep 2
    ({0: 100, 1: 101}, 1, 0),                            # workers do not help: keep none
    ({0: 100, 1: 200, 2: 300, 3: 400, 4: 500}, 2, 4),    # up to the cap: cpus - 1 = 4 for a GPU
    ({0: 100, 1: 240, 2: 248, 3: 250, 4: 250, 5: 251}, 4, 2),  # down from 4 by halving while within 3 %: 2
])
def test_workers_climb_from_the_start_while_they_pay(rates: dict[int, float], first: int, workers: int) -> None:
    measure, calls = fake_measure(rates)
    trials = search(measure, start=start(first), cpus=5, cpu_training=False, cuda=False, budget_s=60)
    chosen = cheapest_within(trials)
    assert chosen.config.num_workers == workers
    assert calls[:2] == [start(first), WorkerSettings(0)]  # the auto plan, then the baseline
    assert len(calls) <= 8  # never the full grid
    assert max(c.num_workers for c in calls) <= 4


def test_trials_after_the_start_race_against_the_best_so_far() -> None:
    measure, _ = fake_measure({0: 100, 1: 180, 2: 250, 3: 255})
    search(measure, start=start(1), cpus=8, cpu_training=False, cuda=False, budget_s=60)
    beats = measure.beats  # type: ignore[attr-defined]
    assert beats[0] is None  # the start is measured to precision
    # the start (1 worker, 4 ahead) measured 180 x 1.01; the baseline races it, as do 2 workers; then 3 race 250
    assert beats[1] == beats[2] == pytest.approx(0.97 * 180 * 1.01) and beats[3] == pytest.approx(0.97 * 250)


def test_stops_when_the_loader_meets_the_compute_rate() -> None:
    measure, calls = fake_measure({0: 100, 1: 295, 2: 300, 3: 300})
    search(measure, start=start(1), cpus=8, cpu_training=False, cuda=False, budget_s=60, compute_rate=300)
    assert max(c.num_workers for c in calls) == 1


def test_cpu_training_pairs_workers_with_threads_and_tries_the_other_split() -> None:
    measure, calls = fake_measure({0: 100, 1: 200, 2: 230}, per_thread={1: 1.0, 2: 1.2})
    trials = search(measure, start=start(1, cpus=2, cpu_training=True), cpus=2, cpu_training=True, cuda=False,
                    budget_s=60)
    # each worker count comes with the threads left beside it (2 CPUs: 1 thread), then the best gets one more
    assert WorkerSettings(1, 4, False, 1) in calls and WorkerSettings(2, 2, False, 1) in calls
    assert WorkerSettings(2, 2, False, 2) in calls
    assert cheapest_within(trials).config == WorkerSettings(2, 2, False, 2)  # 276 beats 230 and 200


@pytest.mark.parametrize(("factor", "backend"), [(1.02, "processes"), (1.10, "threads")])
def test_the_threads_backend_is_tried_and_wins_only_when_clearly_faster(factor: float, backend: str) -> None:
    measure, calls = fake_measure({0: 100, 1: 200, 2: 150}, threads_backend=factor)
    trials = search(measure, start=start(1), cpus=4, cpu_training=False, cuda=False, budget_s=60)
    assert WorkerSettings(1, 4, backend="threads") in calls
    assert cheapest_within(trials).config.backend == backend
    measure, calls = fake_measure({0: 100, 1: 200, 2: 150})
    search(measure, start=start(1), cpus=4, cpu_training=False, cuda=False, budget_s=60, threads_backend=False)
    assert all(c.backend == "processes" for c in calls)


def test_the_other_prefetch_depth_is_tried() -> None:
    measure, calls = fake_measure({0: 100, 1: 200, 2: 150})
    search(measure, start=start(1), cpus=4, cpu_training=False, cuda=False, budget_s=60)
    assert WorkerSettings(1, 2) in calls  # auto gives one worker 4 batches ahead; 2 is cheaper


def test_pinned_memory_only_tried_for_cuda() -> None:
    measure, calls = fake_measure({0: 100, 1: 200, 2: 205})
    search(measure, start=start(1), cpus=4, cpu_training=False, cuda=False, budget_s=60)
    assert not any(c.pin_memory for c in calls)
    measure, calls = fake_measure({0: 100, 1: 200, 2: 205})
    search(measure, start=start(1, cuda=True), cpus=4, cpu_training=False, cuda=True, budget_s=60)
    assert any(c.pin_memory for c in calls)


def test_budget_stops_the_search() -> None:
    measure, calls = fake_measure({0: 100, 1: 200, 2: 300, 3: 400})
    search(measure, start=start(3), cpus=16, cpu_training=False, cuda=True, budget_s=0.0)
    assert calls == [start(3), WorkerSettings(0)]  # only the start and the baseline, which always run


def test_cheapest_within_tolerance() -> None:
    trials = [Trial(WorkerSettings(0), 100, 1), Trial(WorkerSettings(2, 2), 200, 1),
              Trial(WorkerSettings(4, 2), 205, 1), Trial(WorkerSettings(2, 4), 199, 1)]
    assert cheapest_within(trials).config == WorkerSettings(2, 2)  # 200 is within 3 % of 205 and cheaper
    assert cheapest_within(trials, tolerance=0.0).config == WorkerSettings(4, 2)
    with pytest.raises(ValueError, match="no trial"):
        cheapest_within([])


def test_tune_on_tiny_images_caches_the_result_for_make_loader(tiny_images: Path, cache_dir: Path) -> None:
    dataset = ImageFolder(tiny_images / "train", image_size=16)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, targets = batch
        nn.functional.cross_entropy(model(inputs.float() / 255), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    result = tune_loader(dataset, 8, step, budget_s=20)
    data = result.to_json()
    assert {"chosen", "chosen_samples_per_s", "baseline_samples_per_s", "trials", "sweep_seconds"} <= set(data)
    assert data["trials"][0]["config"]["num_workers"] == 0 and len(data["trials"]) >= 2
    assert result.chosen == result.auto or result.chosen_samples_per_s >= (1 - 0.03) * max(
        t.samples_per_s for t in result.trials)
    assert result.chosen_samples_per_s >= result.baseline_samples_per_s or result.chosen.num_workers == 0
    saved = json.loads(cache.cache_path(result.key).read_text())
    assert saved["chosen"] == data["chosen"] and saved["kept_reason"] == result.kept_reason
    if result.confirmation is not None:  # the search's choice was run against auto: both rates are in the record
        assert saved["confirmation"]["auto"] == saved["auto"] and 2 <= len(saved["confirmation"]["auto_rates"]) <= 5
        assert result.chosen == result.confirmation.kept
    else:
        assert result.chosen == result.auto
    loader = make_loader(dataset, 8, workers="tuned")
    assert loader.plan is not None and loader.plan.num_workers == result.chosen.num_workers
    assert loader.plan.cpu_threads == result.chosen.cpu_threads
    assert loader.plan.reasons[0].startswith("tuned by measurement")
    getattr(loader, "close", lambda: None)()


def test_tuned_without_a_result_falls_back_to_auto(tiny_images: Path, cache_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("trainfast")
    logger.addHandler(caplog.handler)
    try:
        loader = make_loader(ImageFolder(tiny_images / "train", image_size=16), 8, workers="tuned")
    finally:
        logger.removeHandler(caplog.handler)
    assert "no tuning result" in caplog.text and loader.plan is not None
    assert not loader.plan.reasons[0].startswith("tuned")


def test_unreadable_cache_is_ignored(tiny_images: Path, cache_dir: Path) -> None:
    dataset = ImageFolder(tiny_images / "train", image_size=16)
    key, _ = cache.cache_key(dataset, 8, with_step=True, device="cpu")
    path = cache.cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert cache.load(dataset, 8, device="cpu") is None
    assert tune_result.load(dataset, 8, device="cpu") is None


def test_fingerprints_tell_datasets_apart(tiny_images: Path) -> None:
    a = cache.dataset_fingerprint(ImageFolder(tiny_images / "train", image_size=16))
    b = cache.dataset_fingerprint(ImageFolder(tiny_images / "train", image_size=32))
    c = cache.dataset_fingerprint((torch.zeros(4, 3), torch.zeros(4)))
    assert len({a, b, c}) == 3


def test_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget_s=0 is not valid"):
        tune_loader((torch.zeros(8, 2), torch.zeros(8)), 4, budget_s=0)
