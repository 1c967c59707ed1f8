"""Steps slow at a period (periodic.py): found at the epoch starts the timeline marks or at equal gaps, what they
cost, the persistent_workers gain taken from it, and the spread note that names them before calling anything noise."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.evidence import noise
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.periodic import epoch_cost, periodic_steps
from trainfast.diagnose.fixes import recommend
from trainfast.diagnose.records.steps import LOG, SAVE, Fractions, LoaderStats, StepRecord


def steps(*seconds: float) -> list[StepRecord]:
    return [StepRecord(end_s=0.0, total_s=s, wait_s=0.0, transfer_s=0.0, host_s=0.0, samples=8, syncs=0)
            for s in seconds]


def jittered(n: int, typical: float = 0.8, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [typical * rng.uniform(0.95, 1.05) for _ in range(n)]


def issue_run() -> tuple[list[float], list[int]]:
    """The issue's trainer: every 8th step (each epoch's first) 1.6-2.6 s against ~0.8 s, 30 steps measured."""
    totals = jittered(30)
    starts = [5, 13, 21, 29]
    for i, slow in zip(starts, (1.6, 2.6, 1.9, 2.2), strict=True):
        totals[i] = slow
    return totals, starts


def test_epoch_starts_that_stand_out_are_periodic_steps_and_cost_their_excess() -> None:
    totals, starts = issue_run()
    found = periodic_steps(steps(*totals), starts)
    assert found is not None and found.epoch_starts and found.stands_out
    assert (found.period, found.starts, found.span) == (8, tuple(starts), 1)
    others = [t for i, t in enumerate(totals) if i not in starts]
    mean = sum(others) / len(others)
    assert found.excess_s == pytest.approx(sum(totals[i] - mean for i in starts) / 4)
    assert found.epoch_s == pytest.approx(8 * mean + found.excess_s)
    assert found.gain == pytest.approx(found.epoch_s / (8 * mean))
    assert found.gain is not None and 1.15 < found.gain < 1.25  # ~1.3 s of excess on a ~6.4 s epoch
    assert found.phrase().startswith("every 8th step (each epoch's first) takes 2.05 s against 0.81 s")
    json = found.to_json()
    assert json["steps"] == starts and json["period"] == 8 and json["excess_s"] == pytest.approx(found.excess_s)


def test_the_steps_after_an_epoch_start_count_when_they_are_slow_too() -> None:
    """New workers fill their queues beside the step: the step after the epoch start is slow as well."""
    totals = jittered(36, typical=0.045)
    starts = [2, 8, 14, 20, 26, 32]
    for i in starts:
        totals[i], totals[i + 1] = 0.23, 0.085
    found = periodic_steps(steps(*totals), starts)
    assert found is not None and found.span == 2 and found.period == 6
    assert found.excess_s == pytest.approx(0.23 + 0.085 - 2 * found.other_mean_s)
    assert "and the step after it 85 ms" in found.phrase()
    # what persistent workers save: the epoch-start step alone, over all the other steps (module doc)
    cost = epoch_cost(steps(*totals), starts)
    assert cost is not None and cost.span == 1 and cost.stands_out
    others = [t for i, t in enumerate(totals) if i not in starts]
    assert cost.excess_s == pytest.approx(0.23 - sum(others) / len(others))
    rec = next(r for r in recommend(evidence(epoch_cost=cost, periodic=found)) if r.id == "persistent_workers")
    assert rec.expected_gain == pytest.approx(cost.gain)
    assert "the 1 step(s) after it, slow too, are not counted" in rec.why


def test_epoch_starts_within_the_spread_are_costed_but_not_called_periodic() -> None:
    totals = jittered(30)
    starts = [5, 13, 21, 29]
    for i in starts:
        totals[i] *= 1.03
    assert periodic_steps(steps(*totals), starts) is None
    cost = epoch_cost(steps(*totals), starts)
    assert cost is not None and not cost.stands_out and cost.span == 1 and cost.excess_s < 0.05
    assert epoch_cost(steps(*totals), [5]) is None  # one epoch start: nothing to take a period from


def test_every_nth_step_is_found_without_epoch_starts() -> None:
    """A checkpoint every 5 steps; one noisy step off the period and one on it that came out fast leave it."""
    totals = jittered(40, typical=0.1)
    for i in range(3, 40, 5):
        totals[i] = 0.4
    totals[3] = 0.1  # a period step that was fast this time
    totals[17] = 0.2  # noise off the period
    found = periodic_steps(steps(*totals))
    assert found is not None and not found.epoch_starts and found.period == 5 and found.starts[0] == 3
    assert found.phrase().startswith("every 5th step takes 400 ms against 10")


def test_uneven_steps_without_a_period_are_not_periodic() -> None:
    """A quarter of the steps slow at random: no period in 97 of 100 such runs (those it finds are runs where chance
    put 4 or more slow steps at equal gaps, three quarters of the slow ones among them)."""
    found = 0
    for seed in range(100):
        rng = random.Random(seed)
        found += periodic_steps(steps(*(rng.choice((0.1, 0.1, 0.1, 0.35)) for _ in range(30)))) is not None
    assert found <= 3
    assert periodic_steps(steps(0.1, 0.5, 0.1)) is None  # too few steps


def contention(cores_busy: float) -> dict[str, Any]:
    return {"other_cores_busy_mean": cores_busy, "other_cores_busy_max": cores_busy, "cores": 2, "samples": 20,
            "own_cores_busy_mean": 1.5}


def test_the_spread_note_names_the_epoch_starts_and_blames_no_machine() -> None:
    totals, starts = issue_run()
    records = steps(*totals)
    found = periodic_steps(records, starts)
    notes = noise.noise_notes(noise.spread(records), contention(0.04), periodic=found, restarted_workers=2)
    [note] = notes
    assert note.startswith("every 8th step (each epoch's first) takes 2.05 s against 0.81 s: the loader restarts its "
                           "2 worker(s) each epoch")
    assert "see persistent_workers" in note and "quieter machine" not in note


def test_what_the_periodic_steps_leave_decides_whose_spread_it_is() -> None:
    totals, starts = issue_run()
    for i in (2, 10, 17, 25):  # the other steps are uneven too
        totals[i] = 2.0
    for i in (3, 11, 18, 26):
        totals[i] = 1.9
    records = steps(*totals)
    found = periodic_steps(records, starts)
    assert found is not None
    quiet = noise.noise_notes(noise.spread(records), contention(0.04), periodic=found, restarted_workers=2)
    assert len(quiet) == 2 and "the other steps' times vary widely" in quiet[1]
    assert "the script's own steps are uneven (other processes kept only 0.04 of 2 cores busy)" in quiet[1]
    assert not any("quieter machine" in n for n in quiet)
    busy = noise.noise_notes(noise.spread(records), contention(1.2), periodic=found, restarted_workers=2)
    assert "quieter machine" in busy[1] and "other processes kept 1.2 of 2 cores busy" in busy[2]


def test_a_wide_spread_without_a_period_is_the_machines_only_when_others_used_the_cpu() -> None:
    records = steps(*([0.2] * 13 + [1.2, 2.0, 3.1, 4.4, 5.0, 6.2, 7.1]))
    spread = noise.spread(records)
    [quiet] = noise.noise_notes(spread, contention(0.03))
    assert "the script's own steps are uneven" in quiet and "quieter machine" not in quiet
    assert "quieter machine" in noise.noise_notes(spread, contention(0.9))[0]


def loader(**overrides: Any) -> LoaderStats:
    values: dict[str, Any] = {"index": 0, "kind": "DataLoader", "dataset": "Images", "num_workers": 2,
                              "pin_memory": False, "persistent_workers": False, "prefetch_factor": 2, "batch_size": 8,
                              "in_memory": False, "decode": None, "batches_per_epoch": 8, "batches": 40,
                              "wait_s": 0.1, "epochs": 6, "startup_s": [0.2, 0.01, 0.01, 0.01, 0.01, 0.01]}
    return LoaderStats(**(values | overrides))


def evidence(**overrides: Any) -> Evidence:
    values: dict[str, Any] = {"verdict": "compute-bound", "device": "cpu", "fractions": Fractions(0.01, 0, 0, 0.99),
                              "step_s": 0.8, "steps": 30, "samples_per_s": 10.0, "syncs_per_step": 0.0, "cpus": 2,
                              "threads": 2, "loaders": (loader(),)}
    return Evidence(**(values | overrides))


def test_persistent_workers_gain_comes_from_the_epoch_start_steps() -> None:
    """iter() to the first batch took 10 ms (1.002x of a 6.4 s epoch); the epoch-start steps took ~1.3 s more."""
    totals, starts = issue_run()
    cost = epoch_cost(steps(*totals), starts)
    assert cost is not None
    rec = next(r for r in recommend(evidence(epoch_cost=cost)) if r.id == "persistent_workers")
    assert rec.gain_basis == "measured" and rec.expected_gain == pytest.approx(cost.gain)
    assert rec.expected_gain is not None and rec.expected_gain > 1.15
    assert f"{cost.excess_s * 1e3:.0f} ms beyond the other steps per epoch start" in rec.why
    assert "epoch of 8 steps" in rec.why and "4 epoch starts measured" in rec.why
    assert rec.overrides == {"persistent_workers": True}
    # epoch starts measured that do not stand out: the restart hides in the steps' spread, nothing to offer
    flat = epoch_cost(steps(*jittered(30)), starts)
    assert "persistent_workers" not in {r.id for r in recommend(evidence(epoch_cost=flat))}
    # fewer than 2 epoch starts measured: iter() to the first batch, as before
    rec = next(r for r in recommend(evidence(loaders=(loader(startup_s=[0.2, 0.5, 0.5]),)))
               if r.id == "persistent_workers")
    assert rec.expected_gain == pytest.approx(1 + 0.5 / (8 * 0.8)) and "from iter() to the first batch" in rec.why


def test_the_timeline_marks_the_steps_in_which_a_training_epoch_began() -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4)  # 3 batches an epoch
    timeline = Timeline(warmup_steps=1)
    with Instrumentation(timeline):
        for epoch in range(4):
            for (x,) in loader:
                model(x).sum().backward()
                optimizer.step()
            if epoch == 1:  # an evaluation epoch: its batches join step 6, which is left out
                model.eval()
                with torch.no_grad():
                    for (x,) in loader:
                        model(x)
                model.train()
    # 12 steps, the first one warm-up, step 6 spanning the evaluation: training epochs began in steps 0 (warm-up),
    # 3, 6 (left out) and 9, the measured rows 2 and 7
    assert timeline.evaluation_steps == 1 and len(timeline.records) == 10
    assert timeline.epoch_starts == [2, 7]


def test_an_evaluation_that_fetches_with_gradients_on_is_no_epoch_start() -> None:
    """The HF Trainer's evaluation: model.eval(), a new loader iterated outside no_grad, each forward under it. Its
    batches are evaluation batches (the model seen training is in eval mode), so its first is no epoch start, and
    the step spanning it is left out like any evaluation's; a save and a print in a step are marked."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    criterion = torch.nn.MSELoss()  # a root with no weights, never put in eval mode
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4)  # one epoch of 12 steps
    timeline = Timeline(warmup_steps=1)
    with Instrumentation(timeline):
        for step, (x,) in enumerate(loader, 1):
            criterion(model(x), torch.zeros(len(x), 1)).backward()
            optimizer.step()
            if step % 4 == 0:
                model.eval()
                for (v,) in DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4):  # gradients on
                    with torch.no_grad():
                        model(v)
                model.train()
            if step % 3 == 0:
                torch.save(model.state_dict(), io.BytesIO())
                print(f"step {step}")
    # 12 steps: the first warm-up, 5 and 9 spanning an evaluation pass (it follows the update of 4 and 8) left out
    assert timeline.evaluation_steps == 2 and len(timeline.records) == 9
    assert timeline.epoch_starts == [] and timeline.left_out == [3, 6]
    # the save and print after the updates of 3, 6 and 9 fall in steps 4, 7 and 10: rows 2, 4 and 6
    assert sorted(i for i, kind in timeline.step_marks if kind == SAVE) == [2, 4, 6]
    assert sorted(i for i, kind in timeline.step_marks if kind == LOG) == [2, 4, 6]


def test_a_period_is_named_by_what_its_steps_did_and_counted_in_the_scripts_steps() -> None:
    totals = jittered(30, typical=0.01)
    starts = [3, 10, 17, 24]
    for i in starts:
        totals[i] = 0.05
    marks = [(i, SAVE) for i in starts] + [(i, LOG) for i in range(0, 30, 2)]  # a print every other step
    # a step spanning an evaluation left out between each two: every 7th record is every 8th of the script's steps
    found = periodic_steps(steps(*totals), (), marks, left_out=[7, 14, 21, 28])
    assert found is not None and found.seen == (SAVE,) and found.period == 7 and found.script_period == 8
    assert found.phrase().startswith("every 8th step (each with a checkpoint save) takes 50 ms")
    note = noise._periodic_note(found, restarted_workers=0)
    assert "a checkpoint save at those steps costs that" in note and "epoch" not in note
    unseen = periodic_steps(steps(*totals))  # nothing marked there: no guess at what it was
    assert unseen is not None and unseen.seen == ()
    assert "did not see there" in noise._periodic_note(unseen, restarted_workers=0)
