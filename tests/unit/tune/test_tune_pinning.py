"""Pinned memory in the tuner's search: the default in every trial for a CUDA target (as make_loader's "auto"),
the unpinned variant the alternative, and no cost in the cheapness ordering there."""

from __future__ import annotations

import pytest

from helpers import fake_measure
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune.search import cheapest_within, search
from trainfast.tune.trial import Trial

START = WorkerSettings(1, 4, True)  # make_loader's "auto" for a CUDA target would start higher; the search is the same


@pytest.mark.parametrize("unpinned", [1.0, 1.02])  # pinning no faster, or unpinned ahead within the noise
def test_cuda_search_pins_every_trial_and_keeps_pinning(unpinned: float) -> None:
    measure, calls = fake_measure({0: 100, 1: 180, 2: 250, 3: 250}, unpinned=unpinned)
    trials = search(measure, start=START, cpus=8, cpu_training=False, cuda=True, budget_s=60)
    assert calls[1] == WorkerSettings(0)  # the tutorials' "before" stays the baseline
    series = [calls[0], *calls[2:-1]]
    assert series and all(c.pin_memory for c in series)
    assert WorkerSettings(2, 2, True) in series
    assert calls[-1] == WorkerSettings(2, 2, False)  # the alternative: the best configuration, unpinned, tried last
    assert cheapest_within(trials, cuda=True).config == WorkerSettings(2, 2, True)


def test_cuda_search_without_workers_still_compares_pinning() -> None:
    measure, calls = fake_measure({0: 100, 1: 101}, unpinned=0.9)
    trials = search(measure, start=START, cpus=8, cpu_training=False, cuda=True, budget_s=60)
    assert WorkerSettings(0, None, True) in calls and WorkerSettings(0) in calls
    assert cheapest_within(trials, cuda=True).config == WorkerSettings(0, None, True)


def test_unpinned_wins_on_cuda_only_when_clearly_faster() -> None:
    measure, _ = fake_measure({0: 100, 1: 180, 2: 250, 3: 250}, unpinned=1.10)
    trials = search(measure, start=START, cpus=8, cpu_training=False, cuda=True, budget_s=60)
    assert cheapest_within(trials, cuda=True).config == WorkerSettings(2, 2, False)


def test_cpu_search_never_pins() -> None:
    measure, calls = fake_measure({0: 100, 1: 180, 2: 250, 3: 250})
    search(measure, start=WorkerSettings(1, 4), cpus=8, cpu_training=False, cuda=False, budget_s=60)
    assert not any(c.pin_memory for c in calls)


@pytest.mark.parametrize(("cuda", "pinned"), [(True, True), (False, False)])
def test_ties_go_to_the_expected_pinning(cuda: bool, pinned: bool) -> None:
    trials = [Trial(WorkerSettings(2, 2, False), 200, 1), Trial(WorkerSettings(2, 2, True), 199, 1)]
    assert cheapest_within(trials, cuda=cuda).config.pin_memory is pinned
    assert cheapest_within(list(reversed(trials)), cuda=cuda).config.pin_memory is pinned


def test_pinning_does_not_outrank_fewer_workers_on_cuda() -> None:
    trials = [Trial(WorkerSettings(1, 2, False), 200, 1), Trial(WorkerSettings(2, 2, True), 201, 1)]
    assert cheapest_within(trials, cuda=True).config == WorkerSettings(1, 2, False)
