"""The search's choice against "auto": interleaved rounds until decided, kept only when decided faster, the
evidence cached and printed; a configuration with more busy threads than CPUs only where it clearly pays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainfast import make_loader
from trainfast.loader import tuned as cache
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune import tuner
from trainfast.tune.confirm import Confirmation, confirm
from trainfast.tune.search import cheapest_within, oversubscribed
from trainfast.tune.trial import Trial

TUNED, AUTO = WorkerSettings(2, 2, False, 1), WorkerSettings(1, 4, False, 1)


def runs(rates: dict[WorkerSettings, list[float]]) -> tuple[Any, list[WorkerSettings]]:
    order: list[WorkerSettings] = []

    def run(config: WorkerSettings) -> Trial:
        order.append(config)
        return Trial(config, rates[config].pop(0), 1.0)
    return run, order


@pytest.mark.parametrize(("tuned_rates", "keeps", "rounds"), [
    ([130, 131, 129], True, 2),           # 1.3x: decided faster from the first 2 rounds
    ([110, 104, 108, 109, 107], True, 5),  # 1.08x: faster, once 5 rounds narrow the interval
    ([102, 110, 101, 103, 102], False, 5),  # one lucky round is not enough: cannot tell at 5 rounds
    ([50, 52, 55], False, 2),             # the oversubscribed choice that trains at half the speed: slower
])
def test_the_choice_is_kept_only_when_it_is_decided_faster(tuned_rates: list[float], keeps: bool,
                                                           rounds: int) -> None:
    run, order = runs({TUNED: list(tuned_rates), AUTO: [100.0] * 5})
    result = confirm(run, TUNED, AUTO)
    assert order[:4] == [TUNED, AUTO, AUTO, TUNED] and len(order) == 2 * rounds  # alternating which goes first
    assert len(result.tuned_rates) == rounds  # it stops as soon as the decision is made
    assert result.keeps_tuned is keeps and result.kept == (TUNED if keeps else AUTO)
    reason = result.reason()
    assert f"{result.tuned_samples_per_s:,.0f} samples/s" in reason and "100 samples/s" not in reason
    assert ("kept" in reason) and (("auto's plan kept" in reason) is not keeps)
    assert Confirmation.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_nothing_to_confirm_when_the_choice_is_auto() -> None:
    with pytest.raises(ValueError, match="auto's own plan"):
        confirm(lambda c: Trial(c, 1.0, 1.0), AUTO, AUTO)


def test_more_busy_threads_than_cpus_is_chosen_only_when_it_beats_every_fitting_one_clearly() -> None:
    fits, over = WorkerSettings(1, 4, False, 1), WorkerSettings(2, 2, False, 1)  # 2 and 3 busy threads on 2 CPUs
    assert oversubscribed(over, 2) and not oversubscribed(fits, 2) and not oversubscribed(WorkerSettings(4, 2), 2)
    close = [Trial(fits, 100, 1), Trial(over, 102, 1)]
    assert cheapest_within(close, cpus=2).config == fits
    assert cheapest_within(close).config == fits  # fewer workers anyway
    clear = [Trial(fits, 100, 1), Trial(over, 110, 1)]
    assert cheapest_within(clear, cpus=2).config == over
    # the cap counts intra-op threads too: 1 worker + 2 threads is 3 busy threads, 2 workers + 0 (a GPU step) fit
    thread_heavy = [Trial(WorkerSettings(1, 4, False, 2), 100, 1), Trial(WorkerSettings(2, 2), 101, 1)]
    assert cheapest_within(thread_heavy).config == WorkerSettings(1, 4, False, 2)
    assert cheapest_within(thread_heavy, cpus=2).config == WorkerSettings(2, 2)


def fake_trials(search_rates: dict[WorkerSettings, float], real: dict[WorkerSettings, float]) -> Any:
    """A run_trial whose search trials (they carry a `precision`) read `search_rates` and whose confirmation runs
    (no precision: a fixed time) read `real`: a choice that looks fast for a few batches and trains slowly."""
    def run_trial(dataset: Any, batch_size: int, config: WorkerSettings, **kw: Any) -> Trial:
        table = search_rates if kw.get("precision") is not None else real
        return Trial(config, table.get(config, 100.0), 0.01, 10)
    return run_trial


def test_a_choice_that_trains_slower_than_auto_is_not_cached(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = (torch.zeros(600, 4), torch.zeros(600, dtype=torch.long))  # in memory: auto plans no workers
    auto = tuner.start_config(data, 8, device="cpu", cpu_training=True)
    slow_in_training = WorkerSettings(1, 4, False, max(1, (auto.cpu_threads or 1) + 1))
    monkeypatch.setattr(tuner, "search", lambda measure, **kw: [measure(auto, None), measure(WorkerSettings(0), None),
                                                               measure(slow_in_training, None)])
    monkeypatch.setattr(tuner, "_compute_rate", lambda *a, **k: 1000.0)
    monkeypatch.setattr(tuner, "run_trial", fake_trials({auto: 100.0, slow_in_training: 150.0},
                                                         {auto: 100.0, slow_in_training: 55.0}))
    result = tuner.tune_loader(data, 8, lambda batch: None, budget_s=6, device="cpu")
    assert result.confirmation is not None and not result.confirmation.keeps_tuned
    assert result.chosen == auto == result.auto and result.chosen_samples_per_s == 100.0
    assert "auto's plan kept" in result.kept_reason and "0.55x" in result.kept_reason
    saved = json.loads(cache.cache_path(result.key).read_text())
    assert saved["chosen"] == auto.to_json() and saved["confirmation"]["kept"] == "auto"
    assert saved["confirmation"]["tuned_samples_per_s"] == 55.0 and saved["confirmation"]["auto_samples_per_s"] == 100.0
    loader = make_loader(data, 8, workers="tuned", device="cpu")
    assert loader.plan is not None and loader.plan.num_workers == auto.num_workers
    assert loader.plan.cpu_threads == auto.cpu_threads


def test_a_choice_that_trains_faster_is_kept_with_its_evidence(cache_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data = (torch.zeros(600, 4), torch.zeros(600, dtype=torch.long))
    auto = tuner.start_config(data, 8, device="cpu", cpu_training=True)
    faster = WorkerSettings(1, 4, False, 1)
    monkeypatch.setattr(tuner, "search", lambda measure, **kw: [measure(auto, None), measure(WorkerSettings(0), None),
                                                               measure(faster, None)])
    monkeypatch.setattr(tuner, "_compute_rate", lambda *a, **k: 1000.0)
    monkeypatch.setattr(tuner, "run_trial", fake_trials({auto: 100.0, faster: 150.0}, {auto: 100.0, faster: 140.0}))
    result = tuner.tune_loader(data, 8, lambda batch: None, budget_s=6, device="cpu")
    assert result.chosen == faster and result.confirmation is not None and result.confirmation.ratio == 1.4
    assert result.kept_reason.endswith("; faster: kept")
    assert result.search_seconds is not None and result.search_seconds <= result.sweep_seconds


def test_a_cache_that_cannot_be_written_costs_only_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             trainfast_log: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TRAINFAST_CACHE", str(blocked / "cache"))  # a real OSError: its parent is a file
    data = (torch.zeros(600, 4), torch.zeros(600, dtype=torch.long))
    auto = tuner.start_config(data, 8, device="cpu", cpu_training=True)
    monkeypatch.setattr(tuner, "search", lambda measure, **kw: [measure(auto, None), measure(WorkerSettings(0), None)])
    monkeypatch.setattr(tuner, "_compute_rate", lambda *a, **k: 1000.0)
    monkeypatch.setattr(tuner, "run_trial", fake_trials({auto: 100.0}, {auto: 100.0}))
    result = tuner.tune_loader(data, 8, lambda batch: None, budget_s=6, device="cpu")
    assert result.chosen == auto
    [warning] = [r.getMessage() for r in trainfast_log.records if "could not cache" in r.getMessage()]
    assert str(cache.cache_path(result.key)) in warning and "TRAINFAST_CACHE" in warning, warning
