"""Stop signals: loader workers leave them to the main process; DDP ranks agree on a stop within seconds."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.trainer import signals
from trainfast.trainer.signals import IgnoreInWorker, StopSchedule, workers_ignore


class Dispositions(Dataset[int]):
    """Each sample is the worker's SIGTERM disposition: ignored (1) or not (0)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return int(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)


def calls(log: list[int]) -> Any:
    def init(worker_id: int) -> None:
        log.append(worker_id)
    return init


def test_workers_started_inside_the_block_ignore_the_stop_signals() -> None:
    own = calls([])
    loader = DataLoader(Dispositions(), batch_size=2, num_workers=1, worker_init_fn=own)
    with workers_ignore((signal.SIGTERM,), loader, None):
        assert isinstance(loader.worker_init_fn, IgnoreInWorker) and loader.worker_init_fn.then is own
        assert [int(b.sum()) for b in loader] == [2, 2]
    assert loader.worker_init_fn is own  # put back
    assert [int(b.sum()) for b in loader] == [0, 0]  # outside the block the workers keep torch's default


def test_make_loaders_workers_ignore_them_too_and_still_run_their_own_init() -> None:
    loader = make_loader(Dispositions(), 2, workers=1, shuffle=False, device="cpu", persistent_workers=False)
    with workers_ignore((signal.SIGTERM,), loader):
        assert [int(b.sum()) for b in loader] == [2, 2]
    loader.close()


def test_the_worker_init_calls_the_loaders_own_after_ignoring() -> None:
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        IgnoreInWorker((signal.SIGUSR2,), calls(seen))(3)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN and seen == [3]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_schedule_agrees_every_few_seconds_whatever_the_step_time() -> None:
    now = [0.0]
    schedule = StopSchedule(every_s=2.0, clock=lambda: now[0])
    agreed_at = []
    for step in range(1, 40):
        now[0] += 0.5  # half a second per step: an agreement every 4 steps
        if schedule.due(step):
            agreed_at.append(step)
            assert schedule.agree(False, step, torch.device("cpu")) is False
    assert agreed_at[:3] == [1, 2, 6] and all(b - a == 4 for a, b in itertools.pairwise(agreed_at[2:]))


def test_slow_steps_agree_at_every_step_and_a_request_is_returned() -> None:
    now = [0.0]
    schedule = StopSchedule(every_s=2.0, clock=lambda: now[0])
    for step in range(1, 5):
        now[0] += 3.0
        assert schedule.due(step)
        assert schedule.agree(step == 4, step, torch.device("cpu")) is (step == 4)


class SignalAtForward(nn.Module):
    """A linear model that sends this process SIGTERM in its `at`-th forward (mid-step, not at a log point)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.linear, self.at, self.calls = nn.Linear(4, 2), at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.linear(x)


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real (gloo, world size 1) process group: the Trainer takes its distributed path in this process."""
    store = dist.FileStore(str(tmp_path / "store"), 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_stop_within_seconds_of_a_signal_not_at_the_next_log_point(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signals, "AGREE_EVERY_S", 0.0)  # every step is "a few seconds" here
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 4, generator=g), torch.randint(0, 2, (256,), generator=g)
    cfg = TrainConfig(epochs=1, log_every=50, checkpoint_dir=str(tmp_path / "ckpt"), device="cpu", progress=False,
                      monitor=False, precision="32-true")  # no precision A/B: its guard's forwards count here
    trainer = Trainer(SignalAtForward(at=3), config=cfg)
    trainer.dist = replace(trainer.dist, world_size=2)  # distributed, as far as the loop can tell
    with pytest.raises(SystemExit):
        trainer.fit(make_loader((x, y), 8, device="cpu"))  # 32 steps; the first log point would be step 50
    state = torch.load(tmp_path / "ckpt" / "last.pt", weights_only=True)
    assert state["step"] == 3 and state["batch"] == 3  # signalled in step 3, agreed at its end
