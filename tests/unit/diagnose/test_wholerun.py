"""The whole run's accounting (wholerun.py) on made-up ledgers: phases that add up, priorities, compile, drift."""

from __future__ import annotations

import pytest

from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.evidence.wholerun import PHASES, account
from trainfast.diagnose.records.ledger import DOCTOR, LOGGING, SLEEP, EvalPass, Write
from trainfast.diagnose.show.scalars import scalars


def ledger_with_steps(n: int, *, start: float = 2.0, step_s: float = 0.1, wait_s: float = 0.01, samples: int = 32,
                      loader: bool = True, slower_after: int | None = None, extra_wait_s: float = 0.0) -> Ledger:
    """`n` contiguous steps from `start` (the process started at 0), each `step_s` long with `wait_s` of data wait
    and a 5 ms input gap; after step `slower_after` each waits `extra_wait_s` more."""
    ledger = Ledger(process_start=0.0, loader_fed=loader)
    t = start
    for i in range(n):
        extra = extra_wait_s if slower_after is not None and i >= slower_after else 0.0
        end = t + step_s + extra
        ledger.step(t, end, wait_s + extra, 0.0, t + 0.005 if i else t, samples, opening=i == 0)
        t = end
    return ledger


def phases(entry: dict) -> dict[str, float]:
    return {p["phase"]: p["seconds"] for p in entry["phases"]}


def test_phases_add_up_to_the_wall_time_and_startup_ends_at_the_first_input() -> None:
    ledger = ledger_with_steps(50)
    end = ledger.step_end[-1] + 0.5  # half a second after the last step: teardown
    entry = account(ledger, end=end, compiled=False, warmup=5)
    got = phases(entry)
    assert [p["phase"] for p in entry["phases"]] == list(PHASES)
    assert sum(got.values()) == pytest.approx(entry["wall_s"]) == pytest.approx(end)
    assert got["startup"] == pytest.approx(2.0) and got["other"] == pytest.approx(0.5)
    assert got["train"] == pytest.approx(5.0) and entry["goodput"] == pytest.approx(5.0 / end)
    assert sum(p["share"] for p in entry["phases"]) == pytest.approx(1.0)
    assert entry["train"]["samples"] == 50 * 32 and entry["seconds_per_sample"] == pytest.approx(end / 1600)
    assert entry["badput"][0]["phase"] == "startup"  # largest first
    assert len(entry["throughput"]) == 20 and all(t["steps"] in (2, 3) for t in entry["throughput"])


def test_evaluation_checkpoint_and_epoch_starts_are_carved_out_of_the_steps_they_fall_in() -> None:
    ledger = ledger_with_steps(40)
    s10 = ledger.step_start[10]
    # inside step 10's input gap: an evaluation pass of 0.5 s, then a 0.2 s save; step 10 is stretched to hold them
    ledger.step_end[10] += 1.0
    for i in range(11, 40):
        ledger.step_start[i] += 1.0
        ledger.step_end[i] += 1.0
    ledger.step_gap[10] = 0.9
    ledger.passes.append(EvalPass(s10 + 0.1, s10 + 0.6, wait_s=0.1, forwards=4))
    ledger.wrote(Write("torch.save", s10 + 0.65, s10 + 0.85, 100_000_000))
    ledger.epoch_starts.append((ledger.step_start[20] - 0.0, ledger.step_start[20] + 0.3, 0.2))
    ledger.intervals.append((LOGGING, ledger.step_start[30], ledger.step_start[30] + 0.001))
    end = ledger.step_end[-1]
    entry = account(ledger, end=end, compiled=False, warmup=5)
    got = phases(entry)
    # the pass runs on past its last forward up to the save (what it does with its outputs: pass_ends)
    assert got["evaluation"] == pytest.approx(0.55) and got["checkpoint"] == pytest.approx(0.2)
    assert got["epoch_start"] == pytest.approx(0.3)
    # the host work around them in step 10's gap (0.1 before, 0.05 after) is "other", not train
    assert entry["other"]["host_s"] == pytest.approx(0.15) and entry["other"]["logging_s"] == pytest.approx(0.001)
    assert sum(got.values()) == pytest.approx(end)
    write = entry["checkpoint"]["writes"][0]
    assert write["bytes"] == 100_000_000 and write["mb_per_s"] == pytest.approx(500) and not write["background"]
    assert entry["checkpoint"]["blocking_s"] == pytest.approx(0.2)
    assert entry["evaluation"]["passes"] == 1 and entry["evaluation"]["data_wait_s"] == pytest.approx(0.1)
    # the epoch's first batch is epoch start, not data wait: 40 x 10 ms less the 0.2 s inside it
    assert entry["train"]["data_wait_s"] == pytest.approx(0.4 - 0.2)


def test_overlaps_go_to_the_higher_priority_and_the_doctors_own_time_leaves_the_wall() -> None:
    ledger = ledger_with_steps(20)
    s5 = ledger.step_start[5]
    ledger.passes.append(EvalPass(s5, s5 + 0.05))  # a save inside an evaluation pass counts as the save
    ledger.wrote(Write("torch.save", s5 + 0.01, s5 + 0.03, None))
    ledger.intervals.append((SLEEP, s5 + 0.04, s5 + 0.07))  # a sleep half inside the pass
    ledger.intervals.append((DOCTOR, 1.0, 1.5))  # the doctor scanned during start-up
    end = ledger.step_end[-1]
    entry = account(ledger, end=end, compiled=False, warmup=5)
    got = phases(entry)
    assert got["checkpoint"] == pytest.approx(0.02) and got["evaluation"] == pytest.approx(0.03)
    assert entry["other"]["sleep_s"] == pytest.approx(0.02)
    assert entry["doctor_s"] == pytest.approx(0.5) and entry["wall_s"] == pytest.approx(end - 0.5)
    assert got["startup"] == pytest.approx(1.5)
    assert sum(got.values()) == pytest.approx(entry["wall_s"])


def test_background_writes_are_listed_not_carved() -> None:
    ledger = ledger_with_steps(20)
    ledger.wrote(Write("torch.save", ledger.step_start[3], ledger.step_start[8], 10, background=True))
    entry = account(ledger, end=ledger.step_end[-1], compiled=False, warmup=5)
    assert phases(entry)["checkpoint"] == 0 and entry["checkpoint"]["count"] == 1
    assert entry["checkpoint"]["blocking_s"] == 0 and entry["checkpoint"]["writes"][0]["background"]


def test_compile_is_the_first_steps_excess_over_the_steady_step_only_when_torch_compile_ran() -> None:
    ledger = ledger_with_steps(30)
    ledger.step_end[0] += 3.0  # the first step compiled for 3 s
    for i in range(1, 30):
        ledger.step_start[i] += 3.0
        ledger.step_end[i] += 3.0
    compiled = account(ledger, end=ledger.step_end[-1], compiled=True, warmup=5)
    eager = account(ledger, end=ledger.step_end[-1], compiled=False, warmup=5)
    assert phases(compiled)["compile"] == pytest.approx(3.0)
    train = compiled["train"]  # the step's parts add up to the train phase, compilation taken out of compute
    assert sum(train[p] for p in ("data_wait_s", "transfer_s", "host_s", "compute_s")) == pytest.approx(
        phases(compiled)["train"])
    assert phases(eager)["compile"] == 0 and phases(eager)["train"] == pytest.approx(phases(compiled)["train"] + 3)


def test_drift_names_the_part_of_the_step_that_grew() -> None:
    steady = account(ledger_with_steps(200), end=30.0, compiled=False, warmup=5)["drift"]
    assert steady["drifted"] is False and "within the noise" in steady["reason"]
    slowing = ledger_with_steps(200, slower_after=150, extra_wait_s=0.05)
    drift = account(slowing, end=slowing.step_end[-1], compiled=False, warmup=5)["drift"]
    assert drift["drifted"] is True and drift["part"] == "data_wait"
    assert drift["change"] == pytest.approx(0.1 / 0.15 - 1, abs=0.01) and "data wait grew" in drift["reason"]
    jitter = ledger_with_steps(200)  # every other step 30 % longer, no trend: noise, not drift
    for i in range(1, 200, 2):
        jitter.step_end[i] += 0.03
        for j in range(i + 1, 200):
            jitter.step_start[j] += 0.03
            jitter.step_end[j] += 0.03
    assert account(jitter, end=jitter.step_end[-1], compiled=False, warmup=5)["drift"]["drifted"] is False
    few = account(ledger_with_steps(8), end=5.0, compiled=False, warmup=5)["drift"]
    assert few["drifted"] is None and "too few" in few["reason"]


def test_without_a_loader_the_input_gap_is_data_wait() -> None:
    entry = account(ledger_with_steps(20, loader=False), end=5.0, compiled=False, warmup=5)
    train = entry["train"]
    assert train["host_s"] == 0 and train["data_wait_s"] == pytest.approx(20 * 0.01 + 19 * 0.005)


def test_a_run_without_steps_is_all_other() -> None:
    entry = account(Ledger(process_start=0.0), end=3.0, compiled=False, warmup=5)
    assert phases(entry)["other"] == pytest.approx(3.0) and entry["goodput"] == 0
    assert entry["throughput"] == [] and entry["seconds_per_sample"] is None


def test_scalars_for_tensorboard_follow_the_intervals() -> None:
    entry = account(ledger_with_steps(40), end=8.0, compiled=False, warmup=5)
    points = scalars(entry)
    assert [step for step, _ in points[:-1]] == [2 * (k + 1) for k in range(20)]
    assert set(points[0][1]) == {"throughput/samples_per_s", "step/data_wait_s", "step/transfer_s", "step/host_s",
                                 "step/compute_s"}
    assert points[-1][1]["run/goodput"] == entry["goodput"] and "phases/evaluation_share" in points[-1][1]


def test_an_evaluation_pass_runs_on_through_its_outputs_up_to_its_print_or_the_next_event() -> None:
    """MNIST's test(): its last forward, then the loss summed with .item() and its result printed; then the next
    epoch. The HF Trainer's evaluate(): its metrics printed, then the checkpoint's preparation and its writes."""
    ledger = ledger_with_steps(20)
    s5, s15 = ledger.step_start[5], ledger.step_start[15]
    ledger.step_gap[5] = ledger.step_gap[15] = 0.09  # each pass in its step's input gap, before the next input
    ledger.passes.append(EvalPass(s5 + 0.01, s5 + 0.05, forwards=2))  # the last forward ends at +0.05 ...
    ledger.intervals.append((LOGGING, s5 + 0.06, s5 + 0.062))  # ... then its metrics: printed at +0.06
    ledger.passes.append(EvalPass(s15 + 0.01, s15 + 0.04, forwards=2))  # no print: it runs on to the save
    ledger.wrote(Write("torch.save", s15 + 0.07, s15 + 0.08, 1000))
    entry = account(ledger, end=ledger.step_end[-1], compiled=False, warmup=5)
    assert phases(entry)["evaluation"] == pytest.approx(0.052 + 0.06)  # (0.01 to 0.062) + (0.01 to the save)
    assert entry["evaluation"]["seconds"] == pytest.approx([0.052, 0.06])
    assert entry["other"]["logging_s"] == pytest.approx(0.0)  # the pass's own print is the pass's
