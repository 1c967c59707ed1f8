"""The candidate fixes timed on the script's own model (probe.py): a copy is timed, never the model itself; a
slower candidate is measured slower and not offered; what cannot apply is not tried; the budget is kept."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from trainfast.diagnose.capture import probe
from trainfast.diagnose.capture.probe import MIN_ROUNDS, Candidate, candidates, run_trials, unwrap
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import trials_wanted
from trainfast.diagnose.records.steps import Fractions
from trainfast.diagnose.records.trials import Trial, TrialRequest


def model_and_input() -> tuple[nn.Module, tuple[tuple[torch.Tensor], dict[str, object]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model, ((torch.randn(8, 16),), {})


@contextlib.contextmanager
def sleeping(seconds: float) -> Iterator[None]:
    time.sleep(seconds)
    yield


@pytest.mark.usefixtures("one_intra_op_thread")  # the base replay one core's work, however busy the cores
def test_a_slower_candidate_is_measured_slower_and_the_model_is_left_untouched() -> None:
    """A 50 ms detour beside a replay of under a millisecond: slower in every round. (The base replay on two threads
    with both cores busy took tens of ms, a detour of 20 ms did not stand out of it.)"""
    model, inputs = model_and_input()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    slow = Candidate("amp", "a 50 ms detour", "slow", lambda: sleeping(0.05))
    trials = run_trials([(model, inputs)], [slow], base_autocast=(), budget_s=10.0)
    trial = trials.get("amp")
    assert trials.reason is None and trial is not None and trial.measured
    assert trial.factor is not None and trial.factor < 0.9 and not trial.faster
    assert trial.rounds >= MIN_ROUNDS and trial.low is not None and trial.low <= trial.factor <= (trial.high or 0)
    # BatchNorm's running statistics and the gradients are the copy's, not the script's model's
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())


def test_a_gain_counts_only_on_the_part_of_compute_the_replay_covers() -> None:
    trial = Trial("amp", "bf16", factor=2.0, base_s=0.05, rounds=7, faster_rounds=7)
    assert trial.gain(compute_share=1.0, compute_s=0.05) == pytest.approx(2.0)
    assert trial.gain(compute_share=1.0, compute_s=0.1) == pytest.approx(1 / (0.5 + 0.25))  # covers half
    assert trial.gain(compute_share=0.5, compute_s=0.05) == pytest.approx(1 / (0.5 + 0.25))


def test_inputs_from_another_graph_are_detached() -> None:
    """A GAN's discriminator last saw the generator's output, whose graph the script's backward freed."""
    gen, disc = nn.Linear(4, 16), nn.Linear(16, 1)
    fake = gen(torch.randn(8, 4))
    disc(fake).sum().backward()  # frees fake's graph
    same = Candidate("channels_last", "nothing", True, contextlib.nullcontext)
    trials = run_trials([(disc, ((fake,), {})), (gen, ((torch.randn(8, 4),), {}))], [same], base_autocast=(),
                        budget_s=5.0)
    assert trials.reason is None and trials.model == "Linear, Linear" and trials.get("channels_last").measured


def test_the_budget_is_kept_and_a_candidate_that_does_not_fit_says_why() -> None:
    """A 0.2 s budget: the candidate's warm-up calls (50 ms each) leave too little for its timed rounds, so none is
    started. Kept is counted in the candidate's calls, not in wall time: the whole call took 1.2 s on a busy machine
    (the copy and the base's calls), more than a run that ignored the budget takes on a quiet one (~0.45 s)."""
    model, inputs = model_and_input()
    calls = []

    def slow_call() -> contextlib.AbstractContextManager[None]:
        calls.append(1)
        return sleeping(0.05)

    slow = Candidate("amp", "a 50 ms detour", "slow", slow_call)
    trials = run_trials([(model, inputs)], [slow], base_autocast=(), budget_s=0.2)
    assert len(calls) == probe.WARMUP_CALLS  # its warm-up, then no timed round
    trial = trials.get("amp")
    assert trial is not None and not trial.measured and "did not fit" in (trial.reason or "")


def wanted(**seen: Any) -> list[TrialRequest]:
    """What the fixes want timed on a CPU run that saw `seen` (fixes/rule.py `trials_wanted`)."""
    values: dict[str, Any] = dict(verdict="", device="cpu", fractions=Fractions.of(total_s=1.0, wait_s=0.0,
                                                                                     transfer_s=0.0, host_s=0.0),
                                  step_s=0.1, steps=10, samples_per_s=100.0, syncs_per_step=0.0, cpus=2, threads=2,
                                  parameter_dtypes=frozenset({"float32"}))
    return trials_wanted(Evidence(**(values | seen)))


def test_what_cannot_apply_is_not_tried() -> None:
    cpu = torch.device("cpu")
    tried, skipped = candidates(wanted(parameter_dtypes=frozenset({"float64"}), bf16_supported=True), device=cpu,
                                autocast=(), threads=2)
    assert tried == [] and not skipped["amp"].applies and "float64" in (skipped["amp"].reason or "")
    tried, skipped = candidates(wanted(conv_weights=3, cpus=1), device=cpu, autocast=(), threads=2)
    assert [c.key for c in tried] == ["channels_last", "threads:1"] and not skipped["amp"].applies
    tried, _ = candidates(wanted(autocast=(("cpu", "bfloat16"),), bf16_supported=True, threads=1), device=cpu,
                          autocast=(("cpu", "bfloat16"),), threads=1)
    assert [c.key for c in tried] == ["fp32", "threads:2"]  # the script's own precision is a candidate too
    nhwc, _ = candidates(wanted(input_layout="channels_last", cpus=1, threads=1), device=cpu, autocast=(), threads=1)
    assert [c.key for c in nhwc] == ["contiguous"]  # and its layout
    with tried[0].context(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_wrappers_are_unwrapped_to_the_model_a_copy_can_take() -> None:
    inner = nn.Linear(2, 2)

    class Wrapper(nn.Module):  # DistributedDataParallel's shape: the model is `.module`
        def __init__(self) -> None:
            super().__init__()
            self.module = inner
    assert unwrap(Wrapper()) is inner and unwrap(inner) is inner


class ConvNet(nn.Module):
    """A conv net with a depthwise kernel, whose strides fit both layouts, and a BatchNorm whose statistics move."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.depthwise = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=8)
        self.norm, self.head = nn.BatchNorm2d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.depthwise(self.conv(x))).mean((2, 3)))


class Uncopyable(ConvNet):  # a wrapper holding a lock, a hook or a process group
    def __deepcopy__(self, memo: object) -> None:
        raise TypeError("cannot pickle '_thread.lock' object")


class RefusesChannelsLast(ConvNet):  # a task wrapper whose .to() does its own thing (timm's refuses the format)
    def to(self, *args: object, **kwargs: object) -> RefusesChannelsLast:
        if "memory_format" in kwargs:
            raise RuntimeError("required rank 4 tensor to use channels_last format")
        return self


def channels_last_and_threads() -> list[Candidate]:
    cpu = torch.device("cpu")
    tried, _ = candidates(wanted(conv_weights=1, cpus=1), device=cpu, autocast=(), threads=torch.get_num_threads())
    return tried


def test_a_model_that_cannot_be_copied_is_replayed_in_place_and_put_back() -> None:
    torch.manual_seed(0)
    model = Uncopyable()
    model(torch.randn(4, 3, 12, 12)).sum().backward()  # mid-accumulation: the script's gradients must survive
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trials = run_trials([(model, ((torch.randn(4, 3, 12, 12),), {}))], channels_last_and_threads(), base_autocast=(),
                        budget_s=20.0)
    assert trials.in_place and trials.reason is None
    assert trials.get("channels_last").measured and trials.get("channels_last").factor is not None
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # BatchNorm's statistics too
    assert all(p.is_contiguous() for p in model.parameters())  # the layout put back
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


def test_a_model_that_cannot_be_copied_under_a_process_group_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "_distributed", lambda: True)
    trials = run_trials([(Uncopyable(), ((torch.randn(3, 3, 8, 8),), {}))], channels_last_and_threads(),
                        base_autocast=(), budget_s=1.0)
    assert trials.reason is not None and "could not be copied" in trials.reason and "other ranks" in trials.reason
    assert not trials.trials


def test_a_wrapper_refusing_the_layout_is_converted_tensor_by_tensor() -> None:
    trials = run_trials([(RefusesChannelsLast(), ((torch.randn(2, 3, 8, 8),), {}))], channels_last_and_threads()[:1],
                        base_autocast=(), budget_s=20.0)
    assert trials.reason is None and trials.get("channels_last").measured


def test_a_candidate_that_fails_is_reported_and_the_others_still_run() -> None:
    def broken(part: object, copied: bool) -> object:
        raise RuntimeError("required rank 4 tensor to use channels_last format")
    model, inputs = model_and_input()
    failing = Candidate("channels_last", "channels_last", True, contextlib.nullcontext, broken)
    also = Candidate("amp", "nothing", "same", contextlib.nullcontext)
    trials = run_trials([(model, inputs)], [failing, also], base_autocast=(), budget_s=10.0)
    failed = trials.get("channels_last")
    assert failed is not None and failed.failed and not failed.measured
    assert "conversion of the model failed" in (failed.reason or "") and "rank 4" in (failed.reason or "")
    assert trials.reason is None and trials.get("amp").measured


def test_a_forward_set_on_the_instance_never_reaches_the_scripts_model() -> None:
    """A library's wrapper of `forward` closes over the original model: the copy runs its class's forward."""
    model, inputs = model_and_input()
    calls = []
    original = model.forward
    model.forward = lambda *a, **k: (calls.append(1), original(*a, **k))[1]  # type: ignore[method-assign]
    run_trials([(model, inputs)], [], base_autocast=(), budget_s=5.0)
    assert calls == [] and all(p.grad is None for p in model.parameters())


def test_gradient_accumulation_replays_cover_more_of_the_step() -> None:
    trial = Trial("fp32", "float32", factor=4.0, base_s=0.05, rounds=7, faster_rounds=7, replays=2.0)
    assert trial.gain(compute_share=1.0, compute_s=0.1) == pytest.approx(4.0)
