"""Does a fix train the same as the baselines (records/losses.py `trains_same`), and the script's loss as the steps'
hook keeps it (capture/losses.py): the scalar each backward is given, per step, under a GradScaler the loss before its
scale, and why none is seen (a backward on a non-scalar, a closure's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.timeline import StopMeasuring, Timeline
from trainfast.diagnose.records.losses import FLOOR, SPREADS, LossTrace, tail, trains_same


@pytest.mark.parametrize(("fix", "baselines", "sds", "same", "why"), [
    # within 3 spreads of the baselines' mean (their range 0.1 is the larger spread)
    (1.25, [1.0, 1.1], [0.02, 0.03], True, "3 x the range"),
    (1.36, [1.0, 1.1], [0.02, 0.03], False, "beyond 3 x the range (0.3 from 1.05)"),
    # two baselines that happen to agree: a baseline's step-to-step sd is the spread, not their ~0 range
    (2.5, [2.0, 2.0001], [0.2, 0.15], True, "3 x a baseline's sd (0.6)"),
    (2.7, [2.0, 2.0001], [0.2, 0.15], False, "beyond 3 x a baseline's sd"),
    # steps whose loss hardly moves (a full batch, converged) and seeded baselines alike: 5 % of the loss
    (1.04, [1.0, 1.0], [0.0, 0.0], True, "the 5 % floor"),
    (1.06, [1.0, 1.0], [0.0, 0.0], False, "beyond the floor"),
    (0.94, [1.0, 1.0], [1e-4, 1e-4], False, "lower counts as much as higher"),
    # the curriculum the workers never see (tests/integration/scripts/curriculum.py's losses, measured)
    (4.45, [0.013, 0.026], [0.006, 0.010], False, "a different model"),
    # one baseline (the other failed): its own sd
    (0.5, [0.45], [0.05], True, "one baseline's sd"),
    # a loss of exactly 0 everywhere: nothing departs
    (0.0, [0.0, 0.0], [0.0, 0.0], True, "zero"),
])
def test_the_trains_same_rule(fix: float, baselines: list[float], sds: list[float], same: bool, why: str) -> None:
    check = trains_same(fix, baselines, sds, steps=(10, 19))
    assert check.same is same, (why, check)
    centre = sum(baselines) / len(baselines)
    spread = max([max(baselines) - min(baselines), *sds])
    assert check.limit == pytest.approx(max(SPREADS * spread, FLOOR * abs(centre)))
    said = check.said()
    assert said.startswith(f"loss {fix:.4g} with it against the baselines' {centre:.4g} over steps 10-19: ")
    assert ("beyond" in said) is not same and (check.reason is None) is same


def test_no_baseline_is_an_error_that_says_what_to_give() -> None:
    with pytest.raises(ValueError, match="no baseline loss: give the loss of at least one baseline run"):
        trains_same(1.0, [], [])


def test_a_trace_reads_the_steps_it_is_asked_for_and_skips_those_without_a_loss() -> None:
    trace = LossTrace(3, (4.0, None, 2.0, 1.0, float("nan"), 3.0), (4, 8))
    assert tail((4, 8)) == (6, 8) and trace.tail_steps == (6, 8)
    assert trace.over((6, 8)) == (2.0, pytest.approx(1.4142135), 2)  # steps 6 and 8; 7's NaN left out
    assert trace.over((20, 30)) is None
    assert LossTrace.from_json(trace.to_json()) == trace
    assert LossTrace.from_json(None).unseen == "the run wrote no loss record"


def _loop(steps: int, body: str) -> LossTrace:
    """`steps` training steps of a tiny model under the hooks (warm-up 2, 4 measured), their losses as read."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    timeline = Timeline(warmup_steps=2, max_steps=4)
    timeline.stop_when_done = True
    with Instrumentation(timeline) as inst:
        try:
            for _ in range(steps):
                x = torch.randn(8, 4)
                loss = model(x).pow(2).mean()
                optimizer.zero_grad()
                if body == "scaled":
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                elif body == "vector":
                    model(x).backward(torch.ones(8, 1))
                    optimizer.step()
                elif body == "closure":
                    def closure(x: torch.Tensor = x) -> float:
                        model(x).pow(2).mean().backward()
                        return 0.0
                    optimizer.step(closure)
                else:
                    loss.backward()
                    optimizer.step()
        except StopMeasuring:
            pass
    return inst.steps.losses.read()


@pytest.mark.parametrize("body", ["plain", "scaled"])
def test_each_steps_loss_is_kept_by_step_and_the_measured_steps_named(body: str) -> None:
    """Under a GradScaler the loss before its scale of 1024: the same figures as without one."""
    trace = _loop(20, body)
    assert trace.unseen is None and trace.first == 0
    assert trace.steps is not None and trace.steps[1] - trace.steps[0] == 3  # the 4 measured steps
    values = [v for v in trace.values if v is not None]
    assert len(values) == trace.steps[1] + 1 and all(0 < v < 10 for v in values), trace
    assert trace.values == _loop(20, "plain").values


@pytest.mark.parametrize(("body", "why"), [("vector", "a backward on a tensor of shape (8, 1), not a scalar loss"),
                                           ("closure", "the backward runs inside optimizer.step(closure)")])
def test_no_scalar_loss_says_why(body: str, why: str) -> None:
    trace = _loop(20, body)
    assert trace.first is None and trace.steps is None and trace.unseen is not None
    assert trace.unseen.startswith(why), trace.unseen
