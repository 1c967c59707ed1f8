"""`trainfast compare`'s pure functions on made-up doctor reports: the changes and their intervals, the gate's three
outcomes (fail, pass, cannot tell), whole runs, and every reason two reports cannot be compared."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from trainfast.decide import drift_bound
from trainfast.diagnose.compare.figures import INCONCLUSIVE, MIN_UNITS, WHOLE_RUN, WINDOW, IncomparableError
from trainfast.diagnose.compare.gate import compare
from trainfast.diagnose.compare.judge import judge
from trainfast.diagnose.compare.units import check_report

BATCH = 32


def window(*, step_s: float = 0.010, spread: float = 0.05, rows: int = 30, seed: int = 1, wait: float = 0.1,
           target: str = "train.py", args: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A window report of `rows` steps of about `step_s` (each x a normal factor of sd `spread`), `wait` of each
    step in data wait, batches of BATCH samples."""
    rng = random.Random(seed)
    timeline, end = [], 0.0
    for _ in range(rows):
        total = step_s * max(0.2, rng.gauss(1.0, spread))
        end += total
        timeline.append({"end_s": end, "total_s": total, "wait_s": wait * total, "transfer_s": 0.0,
                         "host_s": 0.02 * total, "collect_s": 0.0, "compute_s": (0.98 - wait) * total,
                         "samples": BATCH, "syncs": 0})
    report = {"verdict": "compute-bound", "samples_per_s": BATCH * rows / end if rows else None,
              "fractions": None, "step_s": step_s, "step_s_percentiles": None, "timeline": timeline,
              "script": {"target": target, "args": args or [], "outcome": "stopped", "exit_code": 0},
              "loaders": [{"index": 0, "batch_size": BATCH}], "world_size": 1, "contention": None,
              "env": {"torch": "2.13.0", "usable_cpus": 8, "gpus": []}, "step_signal": "optimizer",
              "whole_run": None}
    return report | extra


def whole(*, seconds_per_sample: float = 0.001, spread: float = 0.03, intervals: int = 20, seed: int = 1,
          startup_s: float = 5.0, **extra: Any) -> dict[str, Any]:
    """A whole-run report: `intervals` throughput intervals of 50 steps at about `seconds_per_sample` each (the
    first 3x slower: the warm-up), a startup and an evaluation phase."""
    rng = random.Random(seed)
    throughput, at = [], startup_s
    for i in range(intervals):
        per_sample = seconds_per_sample * max(0.2, rng.gauss(1.0, spread)) * (3 if i == 0 else 1)
        samples = 50 * BATCH
        step_s = per_sample * samples / 50
        throughput.append({"start_s": at, "end_s": at + step_s * 50, "steps": 50, "samples": samples,
                           "samples_per_s": 1 / per_sample, "step_s": step_s, "data_wait_s": 0.1 * step_s,
                           "transfer_s": 0.0, "host_s": 0.05 * step_s, "compute_s": 0.85 * step_s})
        at += step_s * 50
    train_s = sum(t["step_s"] * 50 for t in throughput)
    samples = 50 * BATCH * intervals
    evaluation_s = 0.1 * train_s
    wall = startup_s + train_s + evaluation_s
    phases = [("startup", startup_s), ("compile", 0.0), ("train", train_s), ("evaluation", evaluation_s),
              ("checkpoint", 0.0), ("epoch_start", 0.0), ("other", 0.0)]
    report = window(rows=30, seed=seed)
    report["whole_run"] = {
        "wall_s": wall, "goodput": train_s / wall, "seconds_per_sample": wall / samples, "throughput": throughput,
        "phases": [{"phase": p, "seconds": s, "share": s / wall} for p, s in phases],
        "train": {"steps": 50 * intervals, "samples": samples, "samples_per_s": samples / train_s}}
    return report | extra


# ------------------------------------------------------------------------------------------------ window reports


def test_one_run_a_side_cannot_tell_a_small_change_and_says_what_would() -> None:
    """One report a side knows nothing of the spread between runs: the gate's interval is the drift a run here can
    have (trainfast.decide), the runs' own steps narrow only `within`; "cannot tell" exits 3 unless told."""
    base, new = window(seed=1), window(seed=2)
    c = compare(base, new)
    assert c.kind == WINDOW and c.units == (30, 30)
    assert c.measure.name == "samples/s" and c.measure.base == base["samples_per_s"]
    assert c.measure.new == new["samples_per_s"]
    assert abs(c.slowdown.pct) < 5 and c.slowdown.low_pct < c.slowdown.pct < c.slowdown.high_pct
    assert c.within is not None and c.within.noise_pct < 5  # 5 % step-to-step spread over 30 steps
    assert c.slowdown.high_pct > (drift_bound() - 1) * 100 * 0.9  # the drift between runs, not the steps' spread
    gate = judge(c, 5)
    assert not gate.decided and not gate.failed and gate.exit_code == INCONCLUSIVE
    assert gate.verdict.startswith("warning: cannot tell: NEW is")
    assert "one run a side cannot show the spread between runs" in gate.verdict
    assert "runs a side would tell a 5 % change" in gate.verdict and gate.verdict.endswith("→ exit 3")
    assert judge(c, 5, "pass").exit_code == 0 and judge(c, 5, "fail").exit_code == 1
    assert "→ exit 0" in judge(c, 5, "pass").verdict


@pytest.mark.parametrize("swing", [0.75, 1.0, 1.2, 1.35])
def test_one_run_a_side_of_the_same_script_is_never_called_slower(swing: float) -> None:
    """Adjacent runs of one unchanged script differ by up to 25-35 % here: never exit 1 on that."""
    for seed in range(4):
        c = compare(window(seed=seed), window(seed=seed + 50, step_s=0.010 * swing))
        assert not judge(c, 5).failed


def test_one_run_a_side_fails_only_beyond_what_drift_can_be() -> None:
    assert not judge(compare(window(seed=1), window(seed=2, step_s=0.0115)), 5).failed  # 15 %: drift can do that
    c = compare(window(seed=1), window(seed=2, step_s=0.020))
    gate = judge(c, 5)
    assert gate.failed and gate.exit_code == 1 and gate.decision is not None and gate.decision.slower
    low, high = c.slowdown.low_pct, c.slowdown.high_pct
    assert gate.verdict == (f"NEW is {c.slowdown.pct:.1f} % slower (interval {low:.1f}–{high:.1f} %): more than "
                            "--fail-slower 5 % → exit 1")
    assert not judge(c, 150).failed  # 100 % is within a 150 % allowance


def test_a_faster_new_passes_and_says_faster() -> None:
    c = compare(window(seed=1), window(seed=2, step_s=0.005))
    gate = judge(c, 5)
    assert c.slowdown.pct < -40 and not gate.failed and gate.decided and gate.exit_code == 0
    assert gate.verdict.startswith(f"NEW is {-c.slowdown.pct:.1f} % faster (slowdown interval -")


def test_without_a_threshold_the_line_says_the_change_and_exit_0() -> None:
    c = compare(window(seed=1), window(seed=2, step_s=0.02))
    gate = judge(c, None)
    assert gate.exit_code == 0 and gate.fail_slower_pct is None and gate.decided
    assert gate.verdict == (f"NEW is {c.slowdown.pct:.1f} % slower (interval {c.slowdown.low_pct:.1f}–"
                            f"{c.slowdown.high_pct:.1f} %); no --fail-slower given → exit 0")


def test_each_part_of_the_step_is_seconds_per_step_with_its_interval() -> None:
    base, new = window(seed=1, wait=0.1), window(seed=2, wait=0.3)
    c = compare(base, new)
    parts = {p.name: p for p in c.parts}
    assert list(parts) == ["step", "data wait", "host", "compute"]  # transfer and collection: 0 in both, left out
    rows = base["timeline"]
    assert parts["data wait"].base == pytest.approx(sum(r["wait_s"] for r in rows) / len(rows))
    assert parts["data wait"].change_pct == pytest.approx(200, abs=20)
    low, high = parts["data wait"].interval_pct or (0, 0)
    assert low < parts["data wait"].change_pct < high
    assert parts["step"].unit == "s/step"


def test_a_part_only_new_has_gets_no_ratio() -> None:
    new = window(seed=2)
    for row in new["timeline"]:
        row["transfer_s"] = 0.001
    transfer = next(p for p in compare(window(seed=1), new).parts if p.name == "transfer")
    assert transfer.base == 0 and transfer.new == pytest.approx(0.001)
    assert transfer.ratio is None and transfer.change_pct is None and transfer.interval_pct is None


def test_the_intervals_are_deterministic() -> None:
    base, new = window(seed=1, spread=0.2), window(seed=2, spread=0.2)
    assert compare(base, new).to_json() == compare(base, new).to_json()
    assert compare(base, new, seed=1).within != compare(base, new, seed=2).within  # the steps resampled
    assert compare(base, new, seed=1).slowdown == compare(base, new, seed=2).slowdown  # the decision's: no draws


def test_the_comparison_is_json() -> None:
    c = compare(window(seed=1), window(seed=2))
    payload = json.loads(json.dumps(c.to_json(), allow_nan=False))
    assert payload["kind"] == "window" and payload["units"] == {"base": 30, "new": 30, "of": "steps"}
    assert set(payload["slowdown"]) == {"measure", "pct", "interval_pct", "noise_pct"}
    assert payload["measure"]["name"] == "samples/s" and len(payload["measure"]["interval_pct"]) == 2
    assert payload["phases"] == [] and payload["goodput"] is None and payload["confidence"] == 0.95
    gate = judge(c, 5).to_json()
    assert gate["exit_code"] == 3 and gate["decided"] is False and gate["fail_slower_pct"] == 5
    assert gate["decision"]["verdict"] == "inconclusive" and gate["inconclusive"] == "exit"
    assert payload_speeds(c.to_json()) == 2


def payload_speeds(payload: dict[str, Any]) -> int:
    return len(payload["speeds"]["base"]) + len(payload["speeds"]["new"])


def test_notes_name_what_differs_between_the_runs_themselves() -> None:
    new = window(seed=2, contention={"other_cores_busy_mean": 1.4, "cores": 2},
                 env={"torch": "2.14.0", "usable_cpus": 8, "gpus": []})
    comparison = compare(window(seed=1), new, names=("a.json", "b.json"))
    notes = comparison.notes
    assert any("b.json was measured while other processes kept 1.4 of 2 cores busy" in n for n in notes)
    assert any("torch differs: 2.13.0 in a.json, 2.14.0 in b.json" in n for n in notes)  # a torch upgrade is judged
    assert compare(window(seed=1), window(seed=2)).notes == []
    assert comparison.comparable[1] == "torch: differs (2.13.0, 2.14.0): the change may be torch's"
    assert comparison.comparable[3] == "other processes: busy in b.json (other processes kept 1.4 of 2 cores busy)"


@pytest.mark.parametrize(("env", "said"), [
    ({"usable_cpus": 4}, "the usable CPU counts differ (8 in BASE, 4 in NEW)"),
    ({"gpus": [{"name": "NVIDIA H100"}]}, "the GPUs differ ([] in BASE, ['NVIDIA H100'] in NEW)"),
    ({"cpu": "Intel Xeon"}, "the CPUs differ (AMD EPYC in BASE, Intel Xeon in NEW)")])
def test_runs_on_different_machines_cannot_be_compared(env: dict[str, Any], said: str) -> None:
    base = window(seed=1, env={"torch": "2.13.0", "usable_cpus": 8, "gpus": [], "cpu": "AMD EPYC"})
    new = window(seed=2, env={"torch": "2.13.0", "usable_cpus": 8, "gpus": [], "cpu": "AMD EPYC"} | env)
    with pytest.raises(IncomparableError, match="different machines") as refused:
        compare(base, new)
    assert said in str(refused.value) and "compare runs measured on the same machine" in str(refused.value)


BUSY = {"other_cores_busy_mean": 1.4, "cores": 2}


def test_a_slowdown_measured_under_contention_is_not_blamed_on_the_script() -> None:
    gate = judge(compare(window(seed=1), window(seed=2, step_s=0.020, contention=BUSY)), 5)
    assert not gate.decided and not gate.failed and gate.exit_code == 3
    assert gate.verdict.startswith("warning: cannot tell: NEW is 9")
    assert "NEW was measured while other processes kept 1.4 of 2 cores busy: the slowdown may be theirs" in gate.verdict
    # a slowdown against a contended BASE stands: NEW was slower than a slowed yardstick
    assert judge(compare(window(seed=1, contention=BUSY), window(seed=2, step_s=0.020)), 5).failed


def test_a_pass_against_a_contended_base_is_not_a_pass() -> None:
    c = compare(window(seed=1, contention=BUSY), window(seed=2, step_s=0.005))
    assert c.contended == ("other processes kept 1.4 of 2 cores busy", None)
    gate = judge(c, 5)
    assert not gate.decided and gate.exit_code == 3 and "BASE was measured while other processes" in gate.verdict
    assert judge(compare(window(seed=1), window(seed=2, step_s=0.005, contention=BUSY)), 5).decided  # NEW's passes


def test_half_a_core_of_background_on_a_large_machine_is_not_contention() -> None:
    c = compare(window(seed=1, contention={"other_cores_busy_mean": 0.6, "cores": 64}), window(seed=2, step_s=0.005))
    assert c.contended == (None, None) and c.notes == [] and judge(c, 5).decided


# ------------------------------------------------------------------------------------------------ whole runs


def test_whole_runs_compare_wall_time_per_sample_phases_and_goodput() -> None:
    base, new = whole(seed=1), whole(seed=2)
    c = compare(base, new)
    assert c.kind == WHOLE_RUN and c.units == (19, 19)  # the first interval (the warm-up) is left out
    assert c.measure.name == "wall time per sample" and c.measure.base == base["whole_run"]["seconds_per_sample"]
    assert c.slowdown.measure == "wall time per sample" and abs(c.slowdown.pct) < 5
    assert [r.name for r in c.rates] == ["train samples/s"]
    phases = {p.name: p for p in c.phases}
    assert list(phases) == ["startup", "train", "evaluation"]  # phases with no time in either run are left out
    assert phases["startup"].base == 5.0 and phases["startup"].base_share == pytest.approx(
        5.0 / base["whole_run"]["wall_s"])
    assert phases["train"].interval_pct is None  # one figure per run: no spread
    assert c.goodput is not None and c.goodput.base == base["whole_run"]["goodput"]
    assert [p.name for p in c.parts] == ["step", "data wait", "host", "compute"]
    gate = judge(c, 5)
    assert not gate.failed and not gate.decided  # one run a side


def wholes(seconds_per_sample: float = 0.001, *, seed: int, startup_s: float = 5.0, n: int = 4
           ) -> list[dict[str, Any]]:
    return [whole(seed=seed + i, seconds_per_sample=seconds_per_sample, startup_s=startup_s) for i in range(n)]


def test_a_whole_run_15_percent_slower_per_sample_fails() -> None:
    c = compare(wholes(seed=1), wholes(0.00115, seed=10, startup_s=5.75), paired=True)
    assert c.slowdown.pct == pytest.approx(15, abs=2)
    gate = judge(c, 5)
    assert gate.failed and "% slower in wall time per sample (interval" in gate.verdict


def test_a_slower_startup_alone_is_a_slower_run() -> None:
    """Wall time per sample counts the startup too: a run that trains as fast but starts 60 s later is slower."""
    c = compare(whole(seed=1), whole(seed=1, startup_s=65.0))
    startup = next(p for p in c.phases if p.name == "startup")
    assert startup.change_pct == pytest.approx(1200)
    assert c.slowdown.pct > 5 and judge(c, 5).failed


def test_start_up_noise_alone_cannot_fail_the_gate_but_training_made_slower_does() -> None:
    """The same training, a start-up 20 % longer (the machine's run-to-run noise on a short run): more than 5 %
    slower per sample, but not with BASE's start-up, and one start-up figure a run cannot tell noise from a
    change. A start-up 25 % longer or more fails (test_a_slower_startup_alone_is_a_slower_run)."""
    base, new = wholes(seed=1, startup_s=40.0, n=8), wholes(seed=1, startup_s=48.0, n=8)
    c = compare(base, new, paired=True)
    assert c.decision(1.05).slower and c.without_startup is not None and abs(c.without_startup.pct) < 0.5
    assert c.startup is not None and c.startup[1] / c.startup[0] == pytest.approx(1.2, rel=1e-4)
    gate = judge(c, 5)
    assert not gate.failed and not gate.decided
    assert "with BASE's start-up it would be" in gate.verdict and "startup 40.00 → 48.00 s" in gate.verdict
    # the same start-up noise with training 15 % slower per sample: the slowdown stands without it
    slower = compare(base, wholes(0.00115, seed=2, startup_s=48.0, n=8), paired=True)
    assert slower.without_startup is not None and slower.without_startup.low_pct > 5 and judge(slower, 5).failed
    assert c.to_json()["slowdown_without_startup"]["measure"] == "with BASE's start-up"


def test_time_outside_training_has_no_spread_and_a_note_says_so() -> None:
    """Startup is one figure per run: only training's share of the wall time moves with the resampled intervals."""
    c = compare(whole(seed=1, startup_s=200.0, spread=0.1), whole(seed=2, startup_s=200.0, spread=0.1))
    wall, train = c.within, c.rates[0].interval_pct
    assert wall is not None and train is not None
    assert wall.high_pct - wall.low_pct < (train[1] - train[0]) / 4  # training is ~15 % of the wall time
    assert sum("of its wall time outside training (startup 8" in n and "holds training's noise alone" in n
               for n in c.notes) == 2
    assert not any("outside training" in n for n in compare(whole(seed=1), whole(seed=2)).notes)  # 80 % training


# ------------------------------------------------------------------------------------------------ incomparable


def _refused(base: Any, new: Any) -> str:
    with pytest.raises(IncomparableError) as caught:
        compare(base, new)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_different_script_or_arguments_is_refused() -> None:
    assert "different scripts: BASE ran train.py with no arguments, NEW ran other.py" in _refused(
        window(), window(target="other.py"))
    assert "NEW ran train.py with arguments ['--lr', '0.2']" in _refused(window(), window(args=["--lr", "0.2"]))


def test_a_different_shape_is_refused() -> None:
    assert "1 rank(s), NEW on 2" in _refused(window(), window(world_size=2))
    message = _refused(window(), window(loaders=[{"index": 0, "batch_size": 64}]))
    assert "batch sizes are [32] in BASE and [64] in NEW" in message


def test_a_whole_run_against_a_window_is_refused() -> None:
    message = _refused(whole(), window())
    assert "BASE is a whole-run report" in message and "NEW is a window report" in message


def test_no_or_too_few_measured_steps_are_refused() -> None:
    none = window(rows=0, script={"target": "train.py", "args": [], "outcome": "the script crashed: ValueError"})
    assert "NEW has no measured steps (the script crashed: ValueError)" in _refused(window(), none)
    few = _refused(window(rows=MIN_UNITS - 1), window())
    assert f"BASE has {MIN_UNITS - 1} measured steps; at least {MIN_UNITS} are needed" in few and "--steps" in few
    assert compare(window(rows=MIN_UNITS), window(rows=MIN_UNITS, seed=2)).units == (MIN_UNITS, MIN_UNITS)
    assert "throughput intervals" in _refused(whole(), whole(intervals=MIN_UNITS))  # 9 after the first


def test_no_samples_counted_is_refused() -> None:
    new = window(seed=2)
    for row in new["timeline"]:
        row["samples"] = 0
    assert "NEW counted no samples" in _refused(window(), new)


def test_a_run_that_crashed_is_refused_in_one_line() -> None:
    crashed = window(seed=2, script={"target": "train.py", "args": [], "exit_code": 1,
                                     "error": "Traceback ...\nRuntimeError: boom"})
    with pytest.raises(IncomparableError, match=r"NEW's script crashed \(exit code 1: RuntimeError: boom\)"):
        compare(window(seed=1), crashed)


def test_a_file_that_is_not_a_doctor_report_is_refused() -> None:
    assert "BASE is not a trainfast doctor report (a JSON list" in _refused([1, 2], window())
    report = window()
    del report["timeline"], report["loaders"]
    message = _refused(window(), report)
    assert "NEW is not a trainfast doctor report: it has no 'timeline', 'loaders'" in message
    assert "trainfast doctor --json" in message
    bad_row = window()
    bad_row["timeline"][3] = {"end_s": 1.0}
    assert "malformed" in _refused(bad_row, window())
    with pytest.raises(IncomparableError, match="its 'script' is not a mapping"):
        check_report(window(script="train.py"), "BASE")


# ------------------------------------------------------------------------------------------------ several runs a side


def runs(step_s: float, *, seed: int, swings: tuple[float, ...] = (1.0, 0.98, 1.02)) -> list[dict[str, Any]]:
    """Runs of one script, each at `step_s` times its swing (the machine's run-to-run shift)."""
    return [window(seed=seed + i, step_s=step_s * swing) for i, swing in enumerate(swings)]


def test_a_swing_of_the_machine_fails_neither_one_run_a_side_nor_three() -> None:
    """The same script, one run 22 % slower as a whole (the machine, not the script)."""
    base, new = runs(0.010, seed=1), runs(0.010, seed=10, swings=(1.22, 0.99, 1.01))
    assert not judge(compare(base[0], new[0]), 5).failed  # one a side: within what drift can be
    c = compare(base, new)
    gate = judge(c, 5)
    assert not gate.failed, gate.verdict
    assert c.runs == (3, 3) and c.run_spread_pct[1] is not None and c.run_spread_pct[1] > 10
    assert c.slowdown.low_pct < 0 < c.slowdown.high_pct  # the interval holds the swing (set aside as stalled)


@pytest.mark.parametrize("seed", range(5))
def test_three_runs_a_side_fail_15_percent_and_pass_the_same_script(seed: int) -> None:
    base = runs(0.010, seed=100 * seed)
    assert judge(compare(base, runs(0.0115, seed=100 * seed + 10)), 5).failed
    same = judge(compare(base, runs(0.010, seed=100 * seed + 20)), 5)
    assert not same.failed


def test_versions_of_a_script_compare_on_the_same_data_and_model() -> None:
    base = window(seed=1, target="old.py", compute={"flops_per_step": 1e9})
    new = window(seed=2, target="new.py", compute={"flops_per_step": 1e9})
    with pytest.raises(IncomparableError, match="different scripts"):
        compare(base, new)
    assert "two versions of the script" in compare(base, new, versions=True).comparable[2]
    with pytest.raises(IncomparableError, match="different model: a step counts 1e\\+09 FLOPs"):
        compare(base, new | {"compute": {"flops_per_step": 2e9}}, versions=True)
    other = new | {"loaders": [{"index": 0, "batch_size": BATCH, "dataset": "Other", "batches_per_epoch": 9}]}
    with pytest.raises(IncomparableError, match="different data"):
        compare(base, other, versions=True)


def test_the_runs_of_a_side_are_checked_against_each_other() -> None:
    base = [window(seed=1), window(seed=2, args=["--epochs", "2"])]
    with pytest.raises(IncomparableError, match=r"BASE run 1 ran train\.py with no arguments, BASE run 2 ran"):
        compare(base, runs(0.010, seed=3))
    with pytest.raises(IncomparableError, match="no report given"):
        compare([], window())
