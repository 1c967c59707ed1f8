"""Clocks start and stop only on a synchronised device: `device.synchronize` itself, and where the tuner uses it
(the compute-only rate, each trial, each batch-size try), checked with a recording step and a recording clock."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from trainfast import device as device_module
from trainfast.loader.tuned import WorkerSettings
from trainfast.tune import batch_size as bs
from trainfast.tune import trial as trial_module
from trainfast.tune import tuner
from trainfast.tune.trial import run_trial

Events = list[tuple[Any, ...]]
SYNC, CLOCK = ("sync", "cuda:1"), ("clock",)


# -------------------------------------------------------------------------------------------- the helper itself

@pytest.fixture
def cuda_syncs(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """A CUDA host with two GPUs (current: 0) whose `torch.cuda.synchronize` records the device it was given."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(torch.device(device)))
    return calls


@pytest.mark.parametrize(("spec", "synced"), [
    (torch.device("cuda", 1), [torch.device("cuda", 1)]),
    ("cuda:1", [torch.device("cuda", 1)]),
    (torch.device("cpu"), []),
    ("cpu", []),
])
def test_synchronize_waits_for_the_named_device(cuda_syncs: list[torch.device], spec: Any,
                                                synced: list[torch.device]) -> None:
    device_module.synchronize(spec)
    assert cuda_syncs == synced


def test_synchronize_auto_is_torchruns_device(cuda_syncs: list[torch.device], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    device_module.synchronize("auto")
    assert cuda_syncs == [torch.device("cuda", 1)]


def test_synchronize_without_cuda_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synchronized without CUDA"))
    for spec in ("auto", "cpu", "cuda:1", torch.device("cuda", 0)):
        device_module.synchronize(spec)


# -------------------------------------------------------------------------------------------- where the tuner uses it

@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Events:
    """Records, in order, every `synchronize` and every clock read of the tuner's modules; pinning is faked (the
    trials below target "cuda:1" on a machine without CUDA)."""
    recorded: Events = []
    ticks = itertools.count()

    def synchronize(device: Any) -> None:
        recorded.append(("sync", str(device)))

    def perf_counter() -> float:
        recorded.append(CLOCK)
        return float(next(ticks))

    for module in (tuner, trial_module, bs, device_module):  # DeviceClock (trainfast.device) times them all
        for name, fake in (("synchronize", synchronize), ("time", SimpleNamespace(perf_counter=perf_counter))):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fake)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self)
    return recorded


def data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32).view(n, 1), torch.arange(n)


def test_compute_rate_syncs_after_the_warm_up_and_before_stopping(events: Events) -> None:
    rate = tuner._compute_rate(data(), 4, lambda batch: events.append(("step",)), repeats=3, device="cuda:1")
    assert events == [("step",), SYNC, CLOCK, ("step",), ("step",), ("step",), SYNC, CLOCK]
    assert rate == 3 * 4 / 1.0  # one tick between the two clock reads


@pytest.mark.parametrize("warmup", [1, 2])
def test_a_trial_syncs_after_the_warm_up_and_before_stopping(events: Events, warmup: int) -> None:
    trial = run_trial(data(), 4, WorkerSettings(0), step_fn=lambda batch: events.append(("step",)), batches=3,
                      warmup=warmup, device="cuda:1")
    steps = [i for i, e in enumerate(events) if e == ("step",)]
    assert len(steps) == warmup + 3
    last_warm_up, first_measured, last = steps[warmup - 1], steps[warmup], steps[-1]
    assert events[last_warm_up + 1:first_measured] == [SYNC, CLOCK]  # nothing of the warm-up is timed
    assert events[last + 1:last + 3] == [SYNC, CLOCK]  # and all of the measured steps are
    assert trial.samples_per_s == 3 * 4 / 1.0


def test_a_trial_without_warm_up_starts_its_clock_before_the_first_batch(events: Events) -> None:
    trial = run_trial(data(), 4, WorkerSettings(0), step_fn=lambda batch: events.append(("step",)), batches=3,
                      warmup=0, device="cuda:1")
    first = events.index(("step",))
    assert events[first - 2:first] == [SYNC, CLOCK]
    assert trial.samples_per_s == 3 * 4 / 1.0


class Recording(nn.Module):
    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events, self.net = events, nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.events.append(("forward", x.shape[0]))
        out: torch.Tensor = self.net(x)
        return out


def test_each_batch_size_try_is_timed_between_syncs(events: Events) -> None:
    bs.find_batch_size(Recording(events), torch.randn(4), device="cpu", start=2, max_batch=8)
    forwards = [i for i, e in enumerate(events) if e[0] == "forward"]
    assert [events[i][1] for i in forwards] == [2, 4, 8]
    for i in forwards:
        assert events[i - 2:i] == [("sync", "cpu"), CLOCK]  # the model's copy to the device is not the try's time
        stop = events.index(CLOCK, i)
        assert events[stop - 1] == ("sync", "cpu") and all(e[0] == "sync" for e in events[i + 1:stop])
