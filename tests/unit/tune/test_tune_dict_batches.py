"""The tuner counts samples of dict batches (the leading dimension of the first tensor), not one per dict."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from trainfast.loader.tuned import WorkerSettings
from trainfast.tune import trial as trial_module
from trainfast.tune import tuner
from trainfast.tune.trial import run_trial


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.full((6,), i), "labels": torch.tensor(i % 3)}


def _spy_on_batch_samples(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[int]:
    """Records what `module`'s batch_samples counts for each batch."""
    counted: list[int] = []
    original = module.batch_samples

    def spy(batch: Any, default: int = 1) -> int:
        counted.append(original(batch, default))
        return counted[-1]

    monkeypatch.setattr(module, "batch_samples", spy)
    return counted


def test_a_trial_counts_the_samples_of_dict_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _spy_on_batch_samples(monkeypatch, trial_module)
    steps: list[Any] = []
    trial = run_trial(Tokens(), 8, WorkerSettings(0), step_fn=steps.append, batches=6, warmup=2, device="cpu")
    assert counted == [8] * 6  # the 40 samples are cycled: 5 batches of 8 a pass
    assert all(isinstance(batch, dict) for batch in steps) and len(steps) == 8
    assert trial.samples_per_s > 0


def test_the_compute_rate_counts_samples_of_dict_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _spy_on_batch_samples(monkeypatch, tuner)
    steps: list[Any] = []
    rate = tuner._compute_rate(Tokens(), 8, steps.append, repeats=10)
    assert counted == [8] and len(steps) == 11 and isinstance(steps[0], dict)  # warm-up + 10 timed repeats
    assert rate > 0
