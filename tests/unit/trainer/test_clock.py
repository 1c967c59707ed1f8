"""`StepClock`: per-step wall time and data wait, summarised after the warm-up steps (fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainfast.trainer import clock as clock_module
from trainfast.trainer.clock import WARMUP_STEPS, ClockSummary, StepClock

# (data wait, whole step, samples) per step; binary fractions, so the sums are exact.
STEPS = [(4.0, 8.0, 10), (2.0, 4.0, 20), (1.0, 2.0, 30), (0.5, 1.0, 40), (0.25, 1.0, 50), (0.0, 0.5, 60)]


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def _feed(clock: StepClock, fake: FakeTime, steps: list[tuple[float, float, int]]) -> None:
    for wait, total, samples in steps:
        asked = fake.now
        fake.now += wait
        clock.waited(asked, fake.now)
        fake.now += total - wait
        assert clock.step_done(samples) == fake.now


def _expected(steps: list[tuple[float, float, int]]) -> ClockSummary:
    return ClockSummary(steps=len(steps), samples=sum(s[2] for s in steps), seconds=sum(s[1] for s in steps),
                        data_wait_s=sum(s[0] for s in steps))


def test_warmup_steps_default() -> None:
    assert WARMUP_STEPS == 3
    assert StepClock().warmup_steps == WARMUP_STEPS


@pytest.mark.parametrize("n", range(len(STEPS) + 1))
def test_summary_excludes_warmup_unless_the_run_is_too_short(fake_time: FakeTime, n: int) -> None:
    clock = StepClock()
    _feed(clock, fake_time, STEPS[:n])
    expected = _expected(STEPS[WARMUP_STEPS:n] if n > WARMUP_STEPS else STEPS[:n])
    assert clock.summary() == expected


@pytest.mark.parametrize("last", [1, 2, 4, 6, 100])
def test_summary_last_window(fake_time: FakeTime, last: int) -> None:
    clock = StepClock()
    _feed(clock, fake_time, STEPS)
    assert clock.summary(last=last) == _expected(STEPS[-last:])


def test_summary_last_zero_is_empty(fake_time: FakeTime) -> None:
    clock = StepClock()
    _feed(clock, fake_time, STEPS)
    summary = clock.summary(last=0)
    assert (summary.steps, summary.samples, summary.seconds) == (0, 0, 0)


def test_rates_and_fractions(fake_time: FakeTime) -> None:
    clock = StepClock()
    _feed(clock, fake_time, STEPS)
    s = clock.summary()  # steps 4-6: 150 samples in 2.5 s, 0.75 s of it waiting for data
    assert (s.steps, s.samples, s.seconds, s.data_wait_s) == (3, 150, 2.5, 0.75)
    assert s.samples_per_s == pytest.approx(60.0)
    assert s.data_wait_fraction == pytest.approx(0.3)
    whole = clock.summary(last=len(STEPS))
    assert whole.samples_per_s == pytest.approx(210 / 16.5)
    assert whole.data_wait_fraction == pytest.approx(7.75 / 16.5)


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_custom_warmup(fake_time: FakeTime, warmup: int) -> None:
    clock = StepClock(warmup_steps=warmup)
    _feed(clock, fake_time, STEPS)
    assert clock.summary() == _expected(STEPS[warmup:])


def test_resume_excludes_time_outside_training_steps(fake_time: FakeTime) -> None:
    clock = StepClock(warmup_steps=0)
    _feed(clock, fake_time, STEPS[:2])
    fake_time.now += 500.0  # validation, checkpointing
    clock.resume()
    _feed(clock, fake_time, STEPS[2:4])
    assert clock.step_s == [8.0, 4.0, 2.0, 1.0]
    assert clock.summary() == _expected(STEPS[:4])


def test_time_before_the_first_step_counts_from_construction(fake_time: FakeTime) -> None:
    clock = StepClock(warmup_steps=0)
    fake_time.now += 3.0
    clock.step_done(8)
    assert clock.step_s == [3.0]
    assert clock.samples == [8]


@pytest.mark.parametrize("summary", [ClockSummary(0, 0, 0.0, 0.0), ClockSummary(2, 64, 0.0, 0.0)])
def test_zero_seconds_gives_zero_rates(summary: ClockSummary) -> None:
    assert summary.samples_per_s == 0.0
    assert summary.data_wait_fraction == 0.0


def test_empty_clock(fake_time: FakeTime) -> None:
    assert StepClock().summary() == ClockSummary(0, 0, 0, 0)


def test_the_trainer_syncs_the_device_once_as_warm_up_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA queued warm-up kernels would run on the first measured step's clock: one sync ends the warm-up. The
    only other is at each epoch's end, where the whole-run report closes the epoch's training time."""
    import torch
    from torch import nn

    from trainfast import TrainConfig, Trainer, make_loader
    from trainfast.trainer import loop

    trainer = Trainer(nn.Linear(4, 2), config=TrainConfig(epochs=1, device="cpu", progress=False, monitor=False))
    synced_with: list[int] = []
    monkeypatch.setattr(loop, "synchronize", lambda device: synced_with.append(len(trainer.clock.step_s)))
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    trainer.fit(make_loader((x, y), 8, device="cpu"))
    # before the last warm-up step's end is read, and after the epoch's last step (8 batches of 8)
    assert synced_with == [WARMUP_STEPS - 1, 8]
