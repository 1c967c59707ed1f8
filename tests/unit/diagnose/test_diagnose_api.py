"""diagnose(loader, ...) and the Doctor context manager on tiny CPU loops, on one intra-op thread
(`one_intra_op_thread`): on two, with other processes busy on both cores, these tiny steps took tens of ms, and an
input-bound loop came out balanced, a compute-bound one balanced too (the in-memory loader's gathers slowed as
much as the step)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainfast import Doctor, diagnose

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class SlowDataset(Dataset[tuple[torch.Tensor, int]]):
    """Each sample costs 2 ms to 'load': the input-bound case."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.002)
        return torch.randn(8), i % 2


def test_diagnose_an_input_bound_loader() -> None:
    """16 ms of reads a batch against a step of about a millisecond (on two threads, with both cores busy, the same
    step took 35 ms: "balanced")."""
    model = nn.Linear(8, 2)
    report = diagnose(DataLoader(SlowDataset(), batch_size=8), model=model, steps=6, warmup=1)
    data = report.to_json()
    assert data["verdict"] == "input-bound" and data["steps_measured"] == 6
    assert data["recommendations"][0]["id"] == "num_workers"
    assert data["script"]["loader_samples_per_s"] > 0 and data["script"]["loader_headroom"] > 0
    assert data["samples_per_s"] > 0


def test_diagnose_a_compute_bound_step_on_in_memory_data() -> None:
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: Any) -> None:
        inputs, targets = batch
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    from trainfast import make_loader
    report = diagnose(make_loader((x, y), 16), step, steps=10, warmup=2)
    assert report.verdict is not None and report.verdict.name == "compute-bound"
    assert report.loaders[0].kind == "trainfast TensorLoader"


def test_diagnose_without_a_step_measures_only_the_loader() -> None:
    report = diagnose(DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8), steps=4, warmup=1)
    assert report.verdict is None and report.recommendations == []
    assert any("only the loader was measured" in note for note in report.notes)


def test_doctor_context_manager_around_a_loop() -> None:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(96, 4), torch.randint(0, 2, (96,))), batch_size=8)
    with Doctor(warmup=2) as doctor:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert doctor.report is not None and len(doctor.report.steps) == 10
    assert doctor.report.to_json()["script"]["target"] == "Doctor()"


@pytest.mark.slow
def test_steps_spanning_validation_are_left_out() -> None:
    """A validation pass between two optimizer steps is not that step's data wait (seen in the doctor's own run)."""
    from trainfast import TrainConfig, Trainer, make_loader

    x, y = torch.randn(128, 4), torch.randint(0, 2, (128,))
    slow_val = DataLoader(SlowDataset(), batch_size=64)  # 2 ms per sample: would dominate the step it lands in
    with Doctor(warmup=1) as doctor:
        Trainer(nn.Linear(8, 2), config=TrainConfig(epochs=3, progress=False, device="cpu")).fit(
            make_loader((torch.randn(128, 8), y), 16), slow_val)
    report = doctor.report
    # 128 slow samples per validation pass (~0.3 s) against ~0.2 ms training steps: had they counted, the data
    # wait would be ~99 %
    assert report is not None and report.data_wait_fraction < 0.5
    assert any("spanned an evaluation pass" in note for note in report.notes)
    val_stats = next(s for s in report.loaders if s.dataset == "SlowDataset")
    assert val_stats.evaluation_batches == val_stats.batches > 0
    assert all("SlowDataset" not in r.why for r in report.recommendations)
    del x
