"""What a step is, from the events a script produces (synthetic clock): optimizer steps grouped per iteration,
backward passes without an optimizer, input preparation without a loader, the time budget and extra phases."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from helpers import tick
from trainfast.diagnose.capture import model_hook as instrument_module
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.model_hook import batch_axis, root_modules
from trainfast.diagnose.capture.timeline import StopMeasuring, Timeline

D, G = object(), object()  # two optimizers


def fetch(tl: Timeline, clock: list[float], wait: float, samples: int = 8) -> None:
    asked = clock[0]
    tl.fetched(asked, tick(clock, wait), samples)


def step_without_a_loader(tl: Timeline, clock: list[float], *, batch_s: float, no_grad: int, no_grad_s: float,
                          samples: int, step_s: float) -> None:
    """One iteration of a loop with no loader: prepare the batch, `no_grad` forwards with gradients off (teachers,
    action choices, an evaluation), then the training forward, backward and optimizer step."""
    tick(clock, batch_s)
    for _ in range(no_grad):
        tl.evaluation_forward(clock[0])
        tick(clock, no_grad_s)
    tl.forward(clock[0], samples)
    tick(clock, step_s)
    tl.backward()
    tl.optimizer_step(D)


def test_two_optimizers_per_batch_are_one_step(clock: list[float]) -> None:
    """A GAN: D steps, then G steps, then the next batch: one step, ending at G's step."""
    tl = Timeline(warmup_steps=0)
    for _ in range(3):
        fetch(tl, clock, 0.1)
        tl.forward(tick(clock, 0.0), 8)
        tick(clock, 0.3)
        tl.backward()
        tl.optimizer_step(D)
        tick(clock, 0.5)
        tl.backward()
        tl.optimizer_step(G)
        tick(clock, 0.1)  # logging before the next batch: host time
    tl.finish()
    assert tl.signal == "optimizer" and tl.optimizer_steps == 6 and tl.backwards == 6
    assert len(tl.records) == 3
    first, second = tl.records[0], tl.records[1]
    assert first.total_s == pytest.approx(0.9) and first.wait_s == pytest.approx(0.1) and first.samples == 8
    assert second.total_s == pytest.approx(1.0) and second.host_s == pytest.approx(0.1)


def test_the_same_optimizer_twice_without_a_new_batch_is_two_steps(clock: list[float]) -> None:
    """No loader and no hooked forward: an optimizer stepping again still ends the step before."""
    tl = Timeline(warmup_steps=0)
    for _ in range(3):
        tick(clock, 0.2)
        tl.backward()
        tl.optimizer_step(D)
    tl.finish()
    assert [round(r.total_s, 6) for r in tl.records] == [0.2, 0.2, 0.2]


def test_gradient_accumulation_is_one_step_per_optimizer_step(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=0)
    for _ in range(3):
        for _ in range(4):  # micro-batches
            fetch(tl, clock, 0.05, samples=16)
            tick(clock, 0.1)
            tl.backward()
        tl.optimizer_step(D)
    tl.finish()
    # the first optimizer step shows the backwards were micro-batches; its step began mid-way and is dropped
    assert len(tl.records) == 2 and all(r.samples == 64 for r in tl.records)
    assert tl.records[1].wait_s == pytest.approx(0.2) and tl.records[1].total_s == pytest.approx(0.6)


def test_without_an_optimizer_each_backward_ends_a_step_and_the_update_belongs_to_it(clock: list[float]) -> None:
    """Manual SGD: forward, backward, `p.data.add_(...)`, next batch."""
    tl = Timeline(warmup_steps=1)
    for _ in range(4):
        fetch(tl, clock, 0.1)
        tick(clock, 0.3)
        tl.backward()
        tick(clock, 0.1)  # the manual update
    tl.finish()
    assert tl.signal == "backward" and len(tl.records) == 3
    assert all(r.total_s == pytest.approx(0.5) and r.wait_s == pytest.approx(0.1) for r in tl.records[:2])
    assert tl.records[2].total_s == pytest.approx(0.4)  # the script ended: its last step ends at the backward


def test_an_optimizer_seen_late_restarts_the_count(clock: list[float]) -> None:
    """Accumulating 3 backwards before the first optimizer step: the backwards were micro-batches."""
    tl = Timeline(warmup_steps=1)
    for _ in range(4):  # the first (partial) and second (warm-up) iterations are not measured
        for _ in range(3):
            fetch(tl, clock, 0.1)
            tl.backward()
        tl.optimizer_step(D)
    tl.finish()
    assert tl.signal == "optimizer" and len(tl.records) == 2
    assert all(r.wait_s == pytest.approx(0.3) for r in tl.records)


def test_without_a_loader_the_gap_before_the_first_forward_is_input(clock: list[float]) -> None:
    """nanoGPT's shape: batches sliced from a memmap in the loop; two micro-batches per optimizer step."""
    tl = Timeline(warmup_steps=0)
    for _ in range(3):
        tick(clock, 0.2)  # get_batch() and logging before the forward
        for _ in range(2):
            tl.forward(clock[0], 12)
            tl.forward(tick(clock, 0.0), 12)  # a second call of the model in the same pass counts once
            tick(clock, 0.4)
            tl.backward()
        tl.optimizer_step(D)
    tl.finish()
    assert tl.input_source == "script" and tl.forwards == 12
    record = tl.records[0]
    assert record.wait_s == pytest.approx(0.2) and record.host_s == 0 and record.samples == 24
    assert record.total_s == pytest.approx(1.0)


@pytest.mark.parametrize("loader_fed", [True, False])
def test_the_first_step_starts_at_its_input_not_at_the_scripts_start_up(clock: list[float], loader_fed: bool) -> None:
    """--warmup 0: imports and building the model before the loop are no step's host time or data wait."""
    tl = Timeline(warmup_steps=0)
    tick(clock, 1.5)  # the script's start-up
    for _ in range(2):
        if loader_fed:
            fetch(tl, clock, 0.1)
        tl.forward(tick(clock, 0.0), 8)
        tick(clock, 0.3)
        tl.backward()
        tl.optimizer_step(D)
    tl.finish()
    first = tl.records[0]
    assert first.host_s == 0 and first.total_s == pytest.approx(0.4 if loader_fed else 0.3)
    assert first.wait_s == pytest.approx(0.1 if loader_fed else 0.0)


def test_the_budget_stops_at_the_next_step_boundary(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=0, max_steps=100)
    tl.deadline = 100.6
    fetch(tl, clock, 0.4)
    tl.optimizer_step(D)
    fetch(tl, clock, 0.4)
    with pytest.raises(StopMeasuring) as stop:
        tl.optimizer_step(D)  # at 100.8, past the deadline
    assert stop.value.reason == "budget" and len(tl.records) == 2


def test_extra_phases_are_measured_apart_and_stop_when_all_are_done(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=1, max_steps=2)
    tl.stop_when_done = True
    ended: list[str] = []

    def on_end(name: str) -> None:
        ended.append(name)
        if name == "measure":
            tl.add_phase("threads", warmup=1, steps=1)
    tl.on_phase_end = on_end
    with pytest.raises(StopMeasuring):
        for seconds in (0.1, 0.2, 0.2, 0.9, 0.5):
            tick(clock, seconds)
            tl.step_end()
    assert ended == ["measure", "threads"] and tl.done
    assert [r.total_s for r in tl.records] == pytest.approx([0.2, 0.2])
    assert [r.total_s for r in tl.phase_records("threads")] == pytest.approx([0.5])


def test_seen_counts_everything(clock: list[float]) -> None:
    tl = Timeline(warmup_steps=0)
    fetch(tl, clock, 0.1)
    tl.evaluation_fetch()
    tl.forward(clock[0], 8)
    tl.backward()
    assert tl.seen() == {"batches": 2, "forwards": 1, "backwards": 1, "optimizer_steps": 0}
    assert tl.input_source == "loader"
    assert Timeline().input_source is None


def test_hooks_find_the_model_without_a_loader_and_leave_nothing_behind() -> None:
    """Manual SGD on batches sliced by hand: steps from backward passes, samples from the model's input."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    tl = Timeline(warmup_steps=1)
    with Instrumentation(tl):
        for i in range(0, 64, 16):
            model.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
                model(x[:2])  # an evaluation forward: not a step's input
    assert tl.signal == "backward" and tl.input_source == "script"
    # the first forward came before the model was found (at the first backward), which counts it; evaluation
    # forwards are counted too
    assert tl.training_forwards == 4 and tl.forwards == 8
    assert len(tl.records) == 3 and all(r.samples == 16 for r in tl.records[1:])
    assert model in root_modules() and model[0] not in root_modules()
    assert not model._forward_pre_hooks and torch.autograd.backward.__module__ == "torch.autograd"


def test_a_closure_re_evaluated_by_lbfgs_counts_its_batch_once() -> None:
    """`optimizer.step(closure)` runs forward and backward several times on the same batch: one step, 32 samples."""
    model = nn.Linear(4, 2)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=4)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss
    tl = Timeline(warmup_steps=1)
    with Instrumentation(tl):
        for _ in range(4):
            optimizer.step(closure)
    assert tl.training_forwards > 4 and tl.records and all(r.samples == 32 for r in tl.records)


def test_micro_batches_made_fresh_each_pass_still_add_up() -> None:
    """Gradient accumulation: a new batch per backward pass, maybe at a freed one's address: 2 x 16 samples."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tl = Timeline(warmup_steps=1)
    with Instrumentation(tl):
        for _ in range(4):
            for _ in range(2):
                x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert tl.records and all(r.samples == 32 for r in tl.records)


def test_a_scan_before_any_model_exists_does_not_use_up_the_first_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `no_grad()` block (or a sync) while the data is built, before the model: found at the first backward."""
    made: list[nn.Module] = []  # other tests' modules may still be alive: the scan sees this test's only
    monkeypatch.setattr(instrument_module, "root_modules",
                        lambda: [m for m in root_modules() if any(m is k for k in made)])
    tl = Timeline(warmup_steps=1)
    with Instrumentation(tl):
        with torch.no_grad():  # before any module exists: the scan finds nothing
            x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
        model = nn.Linear(4, 2)
        made.append(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(0, 64, 16):
            nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
            optimizer.step()
            optimizer.zero_grad()
    # the first forward precedes the first backward (the next trigger), whose scan finds the model and counts it
    assert model in root_modules() and tl.training_forwards == 4


class TimeMajorLM(nn.Module):
    """PyTorch's word-language-model example: (seq_len, batch) token ids into a non-batch_first LSTM."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.encoder, self.rnn = nn.Embedding(50, 8), nn.LSTM(8, 8, batch_first=batch_first)
        self.decoder = nn.Linear(8, 50)

    def forward(self, tokens: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(out), hidden


@pytest.mark.parametrize(("batch_first", "shape", "samples"), [(False, (35, 20), 20), (True, (20, 35), 20)])
def test_samples_of_a_time_major_sequence_model_are_its_batch(batch_first: bool, shape: tuple[int, int],
                                                              samples: int) -> None:
    model = TimeMajorLM(batch_first)
    tl = Timeline(warmup_steps=1)
    hidden = (torch.zeros(1, 20, 8), torch.zeros(1, 20, 8))
    with Instrumentation(tl):
        for _ in range(4):
            model.zero_grad()
            out, _ = model(torch.randint(0, 50, shape), hidden)
            out.float().mean().backward()
    assert batch_axis(model) == (0 if batch_first else 1)
    assert all(r.samples == samples for r in tl.records) and len(tl.records) == 3
    assert batch_axis(nn.Sequential(nn.Linear(2, 2))) == 0
    assert batch_axis(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 1, enable_nested_tensor=False)) == 1


def test_a_compiled_model_is_found_by_the_module_torch_compile_returns() -> None:
    """torch.compile's OptimizedModule is what the script calls (its insides are not): it gets the hook."""
    inner = nn.Linear(2, 2)
    compiled = torch.compile(inner)  # nothing is compiled until it is called
    roots = root_modules()
    assert any(m is compiled for m in roots) and not any(m is inner for m in roots)


@pytest.mark.parametrize(("eval_forwards", "measured"), [(0, 4), (1, 4), (2, 4), (5, 3)])
def test_an_evaluation_pass_between_steps_without_a_loader_is_left_out(clock: list[float], eval_forwards: int,
                                                                       measured: int) -> None:
    """nanoGPT evaluates every eval_interval iterations with many no-grad forwards; a teacher model's single
    no-grad forward in every step is not an evaluation pass."""
    tl = Timeline(warmup_steps=0)
    for i in range(4):
        step_without_a_loader(tl, clock, batch_s=0.1, no_grad=eval_forwards if i == 2 else 0, no_grad_s=0.0,
                              samples=8, step_s=0.2)
    tl.finish()
    assert len(tl.records) == measured and tl.evaluation_steps == 4 - measured


@pytest.mark.parametrize("teachers", [1, 3, 5])
def test_teachers_forwards_every_step_are_compute_not_an_evaluation_or_data_wait(clock: list[float],
                                                                                  teachers: int) -> None:
    """Distillation without a loader: slicing the batch takes 0.01 s, then `teachers` no-grad forwards of 0.1 s
    each, then the student's step. Every step is a training step, and the teachers are compute."""
    tl = Timeline(warmup_steps=1)
    for i in range(6):  # step 3 also evaluates: 20 more no-grad forwards
        step_without_a_loader(tl, clock, batch_s=0.01, no_grad=teachers + (20 if i == 3 else 0), no_grad_s=0.1,
                              samples=8, step_s=0.2)
    tl.finish()
    assert tl.evaluation_steps == 1 and len(tl.records) == 4
    assert all(r.wait_s == pytest.approx(0.01) for r in tl.records)
    assert all(r.compute_s == pytest.approx(0.1 * teachers + 0.2) for r in tl.records)


def test_an_rl_loops_action_choices_are_not_evaluations(clock: list[float]) -> None:
    """A DQN: 0-4 greedy action forwards (no grad) before each update, varying with exploration; one step also
    evaluates (40 forwards). Only that one is left out: the usual count is the median, not the fewest."""
    tl = Timeline(warmup_steps=1)  # (a first step has no usual count to go by)
    counts = [4, 4, 3, 0, 4, 4, 3, 4, 40, 4, 0, 4]
    for n in counts:
        step_without_a_loader(tl, clock, batch_s=0.01, no_grad=n, no_grad_s=0.001, samples=32, step_s=0.02)
    tl.finish()
    assert tl.evaluation_steps == 1 and len(tl.records) == len(counts) - 2
