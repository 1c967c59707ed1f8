"""Warm-up + cosine learning-rate factors and the LambdaLR wrapper."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch

from trainfast.trainer.schedule import WarmupCosine, warmup_cosine


@pytest.mark.parametrize(
    ("warmup", "total", "step", "factor"),
    [
        (4, 12, 0, 0.25),
        (4, 12, 1, 0.5),
        (4, 12, 2, 0.75),
        (4, 12, 3, 1.0),  # warm-up reaches the peak at step warmup - 1
        (4, 12, 4, 1.0),  # the decay starts at the peak
        (4, 12, 6, 0.5 * (1 + math.cos(math.pi * 2 / 8))),
        (4, 12, 8, 0.5),  # midpoint of the decay
        (4, 12, 12, 0.0),  # the end
        (4, 12, 50, 0.0),  # past the end: stays at the floor
        (0, 10, 0, 1.0),  # no warm-up
        (0, 10, 5, 0.5),
        (0, 10, 10, 0.0),
        (1, 11, 0, 1.0),
        (1, 11, 6, 0.5),
        (10, 10, 9, 1.0),  # all warm-up: total == warmup
        (10, 10, 10, 1.0),
    ],
)
def test_factor_table(warmup: int, total: int, step: int, factor: float) -> None:
    assert WarmupCosine(warmup, total)(step) == pytest.approx(factor, abs=1e-12)


@pytest.mark.parametrize(("warmup", "total", "final"), [(0, 1, 0.0), (3, 10, 0.0), (20, 1000, 0.0), (5, 50, 0.1),
                                                         (7, 7, 0.0), (2, 0, 0.0)])
def test_factors_are_in_range_and_shaped_right(warmup: int, total: int, final: float) -> None:
    sched = WarmupCosine(warmup, total, final_fraction=final)
    factors = [sched(s) for s in range(total + 20)]
    assert all(final - 1e-12 <= f <= 1.0 for f in factors), min(factors)
    assert all(f > 0 for f in factors[:warmup])
    warm = factors[:warmup]
    assert warm == sorted(warm)  # rising through warm-up
    decay = factors[warmup:]
    assert all(a >= b for a, b in itertools.pairwise(decay))  # never rising after it
    if warmup:
        assert factors[warmup - 1] == 1.0
    assert factors[-1] == pytest.approx(final, abs=1e-12)


def test_warmup_is_linear() -> None:
    sched = WarmupCosine(8, 100)
    steps = [sched(s) for s in range(8)]
    diffs = [b - a for a, b in itertools.pairwise(steps)]
    assert diffs == pytest.approx([1 / 8] * 7)


def test_final_fraction_is_the_floor() -> None:
    sched = WarmupCosine(2, 12, final_fraction=0.1)
    assert sched(12) == pytest.approx(0.1)
    assert sched(7) == pytest.approx(0.1 + 0.9 * 0.5)


def _optimizer(lr: float = 0.5) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _run(opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return lrs


def test_warmup_cosine_drives_a_lambda_lr() -> None:
    opt = _optimizer(0.5)
    sched = warmup_cosine(opt, warmup_steps=4, total_steps=12)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.25)
    lrs = _run(opt, sched, 12)
    assert lrs[2] == pytest.approx(0.5)  # step 3
    assert lrs[7] == pytest.approx(0.25)  # step 8: midpoint
    assert lrs[11] == pytest.approx(0.0, abs=1e-12)


def test_warmup_longer_than_the_run_is_capped() -> None:
    opt = _optimizer(1.0)
    sched = warmup_cosine(opt, warmup_steps=100, total_steps=10)
    fn = sched.lr_lambdas[0]
    assert isinstance(fn, WarmupCosine)
    assert (fn.warmup_steps, fn.total_steps) == (10, 10)
    assert _run(opt, sched, 9)[-1] == pytest.approx(1.0)


@pytest.mark.parametrize("through_torch_save", [False, True])
def test_state_dict_round_trip(through_torch_save: bool) -> None:
    opt = _optimizer()
    sched = warmup_cosine(opt, warmup_steps=5, total_steps=40)
    _run(opt, sched, 9)
    state = sched.state_dict()
    if through_torch_save:
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
    opt2 = _optimizer()
    sched2 = warmup_cosine(opt2, warmup_steps=1, total_steps=3)  # different shape: the state must overwrite it
    sched2.load_state_dict(state)
    fn = sched2.lr_lambdas[0]
    assert (fn.warmup_steps, fn.total_steps, fn.final_fraction) == (5, 40, 0.0)
    assert sched2.last_epoch == sched.last_epoch == 9
    assert _run(opt2, sched2, 10) == pytest.approx(_run(opt, sched, 10))
