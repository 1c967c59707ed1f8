"""trial.py: a trial stops once its rate is known well enough or clearly too slow to matter, and measures exactly
`batches` when it is not asked to stop early; tuned.py/resolve.py: a tuned backend reaches make_loader."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from trainfast import make_loader
from trainfast.loader import ThreadLoader
from trainfast.loader import tuned as cache
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune import result as tune_result
from trainfast.tune.trial import MIN_BLOCKS, Trial, run_trial, t95, uncertainty


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n)


def steady(seconds: float = 0.002):  # type: ignore[no-untyped-def]
    return lambda batch: time.sleep(seconds)


def test_uncertainty_of_evenly_spaced_batches_is_zero_and_needs_enough_blocks() -> None:
    marks = [0.1 * i for i in range(2 * MIN_BLOCKS + 1)]
    assert uncertainty(marks, 2) == pytest.approx(0.0, abs=1e-9)
    assert uncertainty(marks[:-2], 2) is None  # one block short
    noisy = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 9.0, 10.0]  # block times 2, 2, 3, 3
    error = uncertainty(noisy, 2)
    assert error is not None and error == pytest.approx(3.18 * 0.57735 / 2 / 2.5, rel=1e-4)  # t for 3 df


def test_t95_continues_the_table_within_one_percent() -> None:
    for df, exact in ((10, 2.228), (15, 2.131), (20, 2.086), (30, 2.042), (60, 2.000), (120, 1.980)):
        assert t95(df) == pytest.approx(exact, rel=0.01)


def test_without_early_stop_a_trial_measures_exactly_its_batches() -> None:
    trial = run_trial(data(), 4, WorkerSettings(0), step_fn=steady(), batches=30, warmup=2, device="cpu")
    assert trial.batches == 30 and trial.samples_per_s > 0


def test_a_steady_trial_stops_once_its_rate_is_known() -> None:
    trial = run_trial(data(), 4, WorkerSettings(0), step_fn=steady(0.005), batches=200, warmup=2, device="cpu",
                      precision=0.2)
    assert 2 * MIN_BLOCKS <= trial.batches < 200


def test_a_trial_clearly_slower_than_the_best_stops_early() -> None:
    trial = run_trial(data(), 4, WorkerSettings(0), step_fn=steady(0.005), batches=200, warmup=2, device="cpu",
                      beat=1e9)
    assert trial.batches == 2 * MIN_BLOCKS
    assert run_trial(data(), 4, WorkerSettings(0), step_fn=steady(0.005), batches=200, warmup=2, device="cpu",
                     max_s=0.01).batches == 2 * MIN_BLOCKS  # the time cap, after the fewest blocks


def test_a_tuned_threads_backend_reaches_make_loader(cache_dir: Path) -> None:
    dataset = [(torch.zeros(2), 0)] * 600  # any map-style dataset that is not tensors batched in place
    key, describes = cache.cache_key(dataset, 4, with_step=False, device="cpu")
    chosen = WorkerSettings(2, 2, backend="threads")
    tune_result.save(tune_result.TuneResult(chosen, 9.0, WorkerSettings(0), 3.0, [Trial(chosen, 9.0, 1.0, 8)], 1.0,
                                            key, describes))
    loader = make_loader(dataset, 4, workers="tuned", device="cpu")
    assert isinstance(loader, ThreadLoader) and loader.plan.num_workers == 2
    assert "thread-workers=2" in loader.plan.reasons[0]
    loader.close()


def test_a_record_with_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="not a loader configuration"):
        WorkerSettings.from_json({**WorkerSettings(1).to_json(), "backend": "fibers"})
