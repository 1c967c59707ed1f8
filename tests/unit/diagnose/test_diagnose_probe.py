"""The candidate fixes timed on the script's own model (probe.py): a copy is timed, never the model itself; a
slower candidate is measured slower and not offered; what cannot apply is not tried; the budget is kept."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from trainfast.diagnose.probe import MIN_ROUNDS, Candidate, Trial, candidates, run_trials, unwrap


def model_and_input() -> tuple[nn.Module, tuple[tuple[torch.Tensor], dict[str, object]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model, ((torch.randn(8, 16),), {})


@contextlib.contextmanager
def sleeping(seconds: float) -> Iterator[None]:
    time.sleep(seconds)
    yield


def test_a_slower_candidate_is_measured_slower_and_the_model_is_left_untouched() -> None:
    model, inputs = model_and_input()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    slow = Candidate("amp", "a 20 ms detour", "slow", lambda: sleeping(0.02))
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
    model, inputs = model_and_input()
    slow = Candidate("amp", "a 50 ms detour", "slow", lambda: sleeping(0.05))
    started = time.perf_counter()
    trials = run_trials([(model, inputs)], [slow], base_autocast=(), budget_s=0.2)
    assert time.perf_counter() - started < 1.0
    trial = trials.get("amp")
    assert trial is not None and not trial.measured and "did not fit" in (trial.reason or "")


def test_what_cannot_apply_is_not_tried() -> None:
    cpu = torch.device("cpu")
    tried, skipped = candidates(device=cpu, autocast=(), parameter_dtypes={"float64"}, bf16_native=True,
                                nchw_convs=0, threads=2, thread_counts=(2,))
    assert tried == [] and not skipped["amp"].applies and "float64" in (skipped["amp"].reason or "")
    tried, skipped = candidates(device=cpu, autocast=(), parameter_dtypes={"float32"}, bf16_native=False,
                                nchw_convs=3, threads=2, thread_counts=(1, 2))
    assert [c.key for c in tried] == ["channels_last", "threads:1"] and not skipped["amp"].applies
    tried, _ = candidates(device=cpu, autocast=(("cpu", "bfloat16"),), parameter_dtypes={"float32"},
                          bf16_native=True, nchw_convs=0, threads=1, thread_counts=(2,))
    assert [c.key for c in tried] == ["threads:2"]  # the script chose its precision


def test_wrappers_are_unwrapped_to_the_model_a_copy_can_take() -> None:
    inner = nn.Linear(2, 2)

    class Wrapper(nn.Module):  # DistributedDataParallel's shape: the model is `.module`
        def __init__(self) -> None:
            super().__init__()
            self.module = inner
    assert unwrap(Wrapper()) is inner and unwrap(inner) is inner


def test_a_model_that_cannot_be_copied_gives_a_reason() -> None:
    class Holding(nn.Linear):
        def __deepcopy__(self, memo: object) -> None:
            raise TypeError("cannot pickle '_thread.lock' object")
    trials = run_trials([(Holding(2, 2), ((torch.randn(3, 2),), {}))], [], base_autocast=(), budget_s=1.0)
    assert trials.reason is not None and "could not be copied" in trials.reason
