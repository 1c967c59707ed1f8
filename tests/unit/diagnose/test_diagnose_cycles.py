"""The true unit of work of loops that are not "one batch, one backward, one step" (synthetic clock): an LBFGS
`optimizer.step(closure)`, a rollout-then-updates cycle (RL), an evaluation pass; samples/s over the measured
window's wall time."""

from __future__ import annotations

import pytest
import torch

from helpers import tick
from trainfast.diagnose.capture import timeline as timeline_module
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.capture.window import MAX_CYCLE_STEPS

OPT = object()


def update(tl: Timeline, clock: list[float], *, samples: int = 16, prepare_s: float = 0.01, step_s: float = 0.04,
           batch: object = None) -> None:
    tick(clock, prepare_s)
    tl.forward(clock[0], samples, batch)
    tick(clock, step_s)
    tl.backward()
    tl.optimizer_step_begins()
    tl.optimizer_step(OPT)


def rollout(tl: Timeline, clock: list[float], *, forwards: int = 64, each_s: float = 0.005,
            training: bool = True) -> None:
    for _ in range(forwards):
        tl.evaluation_forward(clock[0], training)
        tick(clock, each_s)  # the action choice and the environment's step


def test_an_lbfgs_step_is_one_step_however_many_closure_evaluations(clock: list[float]) -> None:
    """LBFGS evaluates the closure (forward, loss, backward) up to 20 times inside one optimizer.step(closure):
    one step, its input counted once, ending when step() returns."""
    tl = Timeline(warmup_steps=1)
    batch = torch.zeros(16, 3)
    for _ in range(4):
        tl.optimizer_step_begins()
        for _ in range(20):
            tl.forward(clock[0], 16, batch)
            tick(clock, 0.01)
            tl.backward()
        tl.optimizer_step(OPT)
    tl.finish()
    assert tl.signal == "optimizer" and tl.backwards == 80 and tl.optimizer_steps == 4
    assert len(tl.records) == 3 and all(r.samples == 16 for r in tl.records)
    assert all(r.total_s == pytest.approx(0.2) for r in tl.records)
    assert tl.samples_per_s == pytest.approx(16 / 0.2)


def test_a_rollout_before_every_few_updates_is_collection_in_whole_cycles(clock: list[float]) -> None:
    """PPO's shape: a rollout of 64 no-grad forwards in training mode (0.32 s) then 8 updates of 0.05 s. The
    rollout steps are kept, the rollout booked as collection, the window spans whole cycles (from a rollout to
    the next) and samples/s is the samples trained over that wall time: 8 x 16 / (0.32 + 8 x 0.05)."""
    tl = Timeline(warmup_steps=2, max_steps=5)
    tl.stop_when_done = True
    with pytest.raises(timeline_module.StopMeasuring):
        for _ in range(6):
            rollout(tl, clock)
            for _ in range(8):
                update(tl, clock)
    cycle_s = 64 * 0.005 + 8 * 0.05
    records = tl.records
    assert len(records) == 8, "one whole cycle: 5 steps asked, the window runs to the next rollout"
    assert tl.cycle == "whole" and tl.evaluation_steps == 0
    # the rollout and the host work after it, up to the first update's input (its 0.01 s of preparation)
    assert sum(r.collect_s for r in records) == pytest.approx(64 * 0.005 + 0.01)
    assert sum(r.total_s for r in records) == pytest.approx(cycle_s)
    assert tl.samples_per_s == pytest.approx(8 * 16 / cycle_s)
    assert sum(r.wait_s for r in records) == pytest.approx(7 * 0.01)


def test_the_same_forwards_with_the_model_in_eval_mode_are_an_evaluation_pass(clock: list[float]) -> None:
    """nanoGPT's estimate_loss calls model.eval(): its step is left out of the split, but its time still counts in
    samples/s (the window's wall time)."""
    tl = Timeline(warmup_steps=1)
    for i in range(6):
        if i == 3:
            rollout(tl, clock, forwards=20, each_s=0.01, training=False)
        update(tl, clock)
    tl.finish()
    assert tl.evaluation_steps == 1 and len(tl.records) == 4 and tl.cycle is None
    assert all(r.collect_s == 0 for r in tl.records)
    assert tl.samples_per_s == pytest.approx(5 * 16 / (5 * 0.05 + 20 * 0.01))


def test_a_cycle_found_mid_window_starts_the_window_again(clock: list[float]) -> None:
    """The first rollout came before the doctor saw the model (or during the warm-up's scans): the window, begun
    mid-cycle, starts again at the first rollout it sees."""
    tl = Timeline(warmup_steps=1, max_steps=6)
    for _ in range(5):
        update(tl, clock)
    for _ in range(3):
        rollout(tl, clock, forwards=10)
        for _ in range(4):
            update(tl, clock)
    assert [r.collect_s > 0 for r in tl.records] == [True, False, False, False] * 2
    assert tl.cycle == "whole"


def test_a_cycle_longer_than_the_window_allows_ends_mid_cycle(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=0, max_steps=2)
    rollout(tl, clock)
    for _ in range(MAX_CYCLE_STEPS * 2 + 3):
        update(tl, clock)
    assert len(tl.records) == MAX_CYCLE_STEPS * 2 and tl.cycle == "partial"
