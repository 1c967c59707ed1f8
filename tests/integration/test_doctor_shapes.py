"""The doctor on training loops written the way people write them (tests/integration/scripts/): a manual SGD
update with no optimizer, nanoGPT's memmap loop with no DataLoader, the ImageNet example's loop, a GAN with two
optimizers, Hugging Face-style dict batches, gradient accumulation; and a script that never takes a step.

Each script prints its own samples/s; the doctor's figure must agree with it. Scripts run with `--threads 1`:
on this shared 2-core machine two intra-op threads spin against other processes and a step's time swings
tenfold, which no comparison survives.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainfast.diagnose import VERDICTS, DoctorRun, run_doctor

SCRIPTS = Path(__file__).parent / "scripts"
STEPS, WARMUP, MAX_SECONDS = 12, 3, 60.0
RATE_TOLERANCE = 0.25  # the doctor's samples/s against the script's own figure
FALSE_ALARMS = {"copy_on_read", "host_sync"}  # none of these loops copies on read; on the CPU a sync is free


pytestmark = pytest.mark.usefixtures("nothing_left_patched")  # after every doctor run, the process as before it


def doctor(script: str, *args: str, steps: int = STEPS, warmup: int = WARMUP) -> tuple[dict, DoctorRun]:
    run = run_doctor(str(SCRIPTS / script), args=["--threads", "1", *args], steps=steps, warmup=warmup,
                     max_seconds=MAX_SECONDS)
    return run.report.to_json(), run


def own_rates(printed: str) -> list[float]:
    """The script's own samples/s lines, the first one (which includes the warm-up) left out."""
    return [float(r) for r in re.findall(r"samples/s\s+([0-9]+(?:\.[0-9]*)?)", printed)][1:]


def assert_rate_agrees(report: dict, printed: str, tolerance: float = RATE_TOLERANCE, lines: int = 2) -> None:
    """The doctor's samples/s within RATE_TOLERANCE of the script's: of the median of its measured-phase lines,
    or of their pooled rate (every window here holds as many samples, so the pooled rate is their harmonic
    mean), so that one window slowed by the machine's other tenants cannot decide the test."""
    rates = own_rates(printed)
    assert len(rates) >= lines, f"too few rate lines after the first:\n{printed}"
    doctor_rate = report["samples_per_s"]
    assert isinstance(doctor_rate, float) and doctor_rate > 0, doctor_rate
    own = (statistics.median(rates), statistics.harmonic_mean(rates))
    assert any(abs(doctor_rate / r - 1) <= tolerance for r in own), (
        f"doctor {doctor_rate:.1f} samples/s, script median {own[0]:.1f} / pooled {own[1]:.1f} ({rates})")


def assert_stopped_and_sane(report: dict, run: DoctorRun, steps: int = STEPS) -> None:
    assert run.exit_code == 0, run.error
    assert report["script"]["outcome"].startswith("stopped after"), report["script"]["outcome"]
    assert report["steps_measured"] == steps
    assert report["verdict"] in VERDICTS
    pct = report["step_s_percentiles"]
    assert set(pct) == {"p10", "p50", "p90"} and 0 < pct["p10"] <= pct["p50"] <= pct["p90"], pct
    assert isinstance(report["data_wait_fraction"], float) and 0.0 <= report["data_wait_fraction"] <= 1.0
    alarms = {r["id"] for r in report["recommendations"]} & FALSE_ALARMS
    assert not alarms, f"false alarms {alarms}: {report['recommendations']}"


def near(value: int, expected: int, slack: int) -> bool:
    return abs(value - expected) <= slack


def iterations_ok(count: int, steps: int = STEPS, warmup: int = WARMUP) -> bool:
    """`steps + warmup` training iterations and the one whose FLOPs are counted after them, or one more: a loop
    whose first optimizer step follows several backwards (a GAN, gradient accumulation) has its first iteration
    dropped, as begun mid-step. (A compiled model gets no counted step: one fewer.)"""
    return steps + warmup <= count <= steps + warmup + 2


def test_manual_sgd_lm_steps_on_each_backward(capsys: pytest.CaptureFixture[str]) -> None:
    """word_language_model: no optimizer and no DataLoader; `p.data.add_` after each backward is the step.
    Left alone it would train 40 epochs."""
    report, run = doctor("manual_sgd_lm.py", "--log-interval", str(WARMUP))
    assert_stopped_and_sane(report, run)
    assert report["step_signal"] == "backward" and report["input_source"] == "script"
    seen = report["seen"]
    assert seen["optimizer_steps"] == 0 and iterations_ok(seen["backwards"]), seen
    assert seen["forwards"] >= seen["backwards"]
    assert report["loaders"] == []
    assert report["verdict"] == "compute-bound", report["verdict_reason"]
    assert_rate_agrees(report, capsys.readouterr().out)


def test_memmap_gpt_without_a_loader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nanoGPT: batches sliced from an np.memmap in the loop, gradient accumulation of 2 with the next batch
    fetched between forward and backward, AdamW: one step per optimizer step, inputs prepared by the script."""
    report, run = doctor("memmap_gpt.py", "--data-dir", str(tmp_path), "--log-interval", str(WARMUP))
    assert_stopped_and_sane(report, run)
    assert report["step_signal"] == "optimizer" and report["input_source"] == "script"
    assert report["loaders"] == []
    seen = report["seen"]
    assert iterations_ok(seen["optimizer_steps"]), seen
    assert 2 * seen["optimizer_steps"] <= seen["backwards"] <= 2 * seen["optimizer_steps"] + 1, seen  # 2 micro-steps
    assert report["verdict"] == "compute-bound", report["verdict_reason"]
    assert_rate_agrees(report, capsys.readouterr().out)


@pytest.mark.slow
def test_classify_loop_decoding_in_the_main_process_is_input_bound(
        tiny_images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The ImageNet example's loop, num_workers=0: JPEG decode + crop in the main process outweighs the small
    conv net."""
    report, run = doctor("classify_loop.py", str(tiny_images / "train"), "--workers", "0",
                         "--print-freq", str(WARMUP))
    assert_stopped_and_sane(report, run)
    assert report["step_signal"] == "optimizer" and report["input_source"] == "loader"
    assert report["verdict"] == "input-bound", report["verdict_reason"]
    assert report["data_wait_fraction"] > 0.3
    assert report["loaders"][0]["num_workers"] == 0
    assert iterations_ok(report["seen"]["optimizer_steps"]), report["seen"]
    assert near(report["loaders"][0]["batches"], report["seen"]["optimizer_steps"], 1), report["loaders"]
    assert_rate_agrees(report, capsys.readouterr().out)


@pytest.mark.slow
def test_classify_loop_manual_update_and_validation(tiny_images: Path) -> None:
    """No optimizer (a manual `p.data.add_` update) and a validation loader under torch.no_grad() every
    epoch (5 batches here): its batches are seen but define no step."""
    report, run = doctor("classify_loop.py", str(tiny_images / "train"), "--val", str(tiny_images / "val"),
                         "--optimizer", "manual")
    assert_stopped_and_sane(report, run)
    assert report["step_signal"] == "backward" and report["input_source"] == "loader"
    seen = report["seen"]
    # a step that spans a validation pass is not measured: one more step per epoch boundary at most
    epochs = (STEPS + WARMUP) // 5
    assert seen["optimizer_steps"] == 0 and STEPS + WARMUP <= seen["backwards"] <= STEPS + WARMUP + epochs + 1, seen
    assert near(report["loaders"][0]["batches"], seen["backwards"], 1), report["loaders"]  # a backward per batch
    # the training batches span three epochs or more: two validation passes of 3 batches at least, and the
    # validation loader's batches are seen too
    assert seen["batches"] >= report["loaders"][0]["batches"] + 6, seen
    assert report["verdict"] == "input-bound", report["verdict_reason"]


@pytest.mark.slow
def test_gan_two_optimizers_per_batch_are_one_step(capsys: pytest.CaptureFixture[str]) -> None:
    """DCGAN: optimizerD.step() then optimizerG.step() on every batch: one step per batch, not two."""
    steps, warmup = 10, 2
    report, run = doctor("gan_two_optimizers.py", "--print-freq", str(warmup), steps=steps, warmup=warmup)
    assert_stopped_and_sane(report, run, steps=steps)
    assert report["step_signal"] == "optimizer" and report["input_source"] == "loader"
    seen, batches = report["seen"], report["loaders"][0]["batches"]
    counted = 1  # the step whose FLOPs are counted after the measured ones
    assert near(seen["optimizer_steps"], 2 * (steps + warmup + counted), 2), seen
    assert near(batches, steps + warmup + counted, 2), report["loaders"]
    assert seen["optimizer_steps"] in (2 * (batches - 1), 2 * batches), (seen, batches)  # D and G on every batch
    assert 3 * (batches - 1) <= seen["backwards"] <= 3 * batches, (seen, batches)  # errD_real, errD_fake, errG
    assert report["verdict"] == "compute-bound", report["verdict_reason"]
    assert_rate_agrees(report, capsys.readouterr().out)


@pytest.mark.slow
def test_dict_batches_tokenized_in_getitem_are_input_bound(capsys: pytest.CaptureFixture[str]) -> None:
    """Hugging Face style: dict batches, `model(**batch)`, a slow pure-Python tokenizer in __getitem__ with
    num_workers=0; samples are counted from the dict's tensors."""
    report, run = doctor("dict_batches.py", "--log-steps", str(WARMUP))
    assert_stopped_and_sane(report, run)
    assert report["step_signal"] == "optimizer" and report["input_source"] == "loader"
    assert report["verdict"] == "input-bound", report["verdict_reason"]
    assert report["data_wait_fraction"] > 0.4
    assert_rate_agrees(report, capsys.readouterr().out)


@pytest.mark.slow
def test_gradient_accumulation_is_one_step_per_optimizer_step(capsys: pytest.CaptureFixture[str]) -> None:
    """Four micro-batches, four backwards, one optimizer.step(): one step of 64 samples."""
    report, run = doctor("grad_accum.py", "--log-steps", str(WARMUP))
    assert_stopped_and_sane(report, run)
    assert report["step_signal"] == "optimizer" and report["input_source"] == "loader"
    seen, batches = report["seen"], report["loaders"][0]["batches"]
    assert iterations_ok(seen["optimizer_steps"]), seen
    assert 4 * seen["optimizer_steps"] <= seen["backwards"] <= 4 * seen["optimizer_steps"] + 3, seen
    assert 4 * seen["optimizer_steps"] <= batches <= 4 * seen["optimizer_steps"] + 4, report["loaders"]
    assert report["verdict"] != "input-bound", report["verdict_reason"]  # the data is in memory
    assert_rate_agrees(report, capsys.readouterr().out)


# The loops whose unit of work is not one batch, one backward, one step: within 15 % of the script's own rate
CYCLE_TOLERANCE = 0.15


@pytest.mark.slow
def test_lbfgs_closure_evaluations_are_one_step(capsys: pytest.CaptureFixture[str]) -> None:
    """time_sequence_prediction: `optimizer.step(closure)` with LBFGS evaluates the closure up to `max_iter` times
    per step (10 here, on sequences of 20: the example's 20 on 40 take 4x as long and show nothing more): one step
    each (not 10), the optimizer seen, samples counted once per step, the model's float64 kept out of mixed
    precision."""
    report, run = doctor("lbfgs_closure.py", "--print-freq", str(WARMUP), "--max-iter", "10", "--length", "20")
    assert_stopped_and_sane(report, run)
    seen = report["seen"]
    assert report["step_signal"] == "optimizer" and iterations_ok(seen["optimizer_steps"]), seen
    assert 9 * seen["optimizer_steps"] <= seen["backwards"] <= 10 * seen["optimizer_steps"], seen
    assert report["observed"]["parameters"] > 0
    assert "amp" not in {r["id"] for r in report["recommendations"]}  # autocast leaves float64 alone
    assert_rate_agrees(report, capsys.readouterr().out, CYCLE_TOLERANCE)


@pytest.mark.slow
@pytest.mark.usefixtures("one_intra_op_thread")
def test_a_rollout_between_updates_is_its_own_share_over_whole_cycles(capsys: pytest.CaptureFixture[str]) -> None:
    """PPO's shape without gym: a rollout of no-grad action choices in training mode and environment steps, then
    16 minibatch updates. The rollout is booked as collection (the script's own share, ~40 %), the window spans
    a whole cycle (16 steps, more than the 12 asked for), samples/s is over its wall time. The small MLP is also
    a model where bf16 is slower than fp32 on a CPU: measured slower, it is not recommended. (On one intra-op
    thread: on two, with other processes busy on both cores, the replays' rounds varied more than bf16's cost, and
    once bf16 was measured faster and recommended.)"""
    report, run = doctor("rollout_updates.py")
    assert run.exit_code == 0, run.error
    assert report["steps_measured"] == 16 and report["step_signal"] == "optimizer"
    printed = capsys.readouterr().out
    own_share = [float(s) / 100 for s in re.findall(r"rollout (\d+)%", printed)][1:]
    assert own_share, printed
    assert abs(report["fractions"]["collection"] - statistics.median(own_share)) <= 0.1, (report["fractions"],
                                                                                          own_share)
    assert any("collects between updates" in n and "whole cycles" in n for n in report["notes"]), report["notes"]
    assert_rate_agrees(report, printed, CYCLE_TOLERANCE, lines=1)  # a line per cycle; the window is one cycle
    trials = {t["id"]: t for t in report["observed"]["trials"]["trials"]}
    assert "amp" not in {r["id"] for r in report["recommendations"]}
    if trials["amp"]["applies"]:  # a CPU with native bf16: timed, slower, said so
        assert trials["amp"]["factor"] < 1, trials["amp"]
        assert any(n.startswith("mixed precision not recommended") for n in report["notes"]), report["notes"]


@pytest.mark.slow
def test_a_fabric_loop_reaching_its_model_through_wrapper_methods(tmp_path: Path) -> None:
    """Lightning Fabric's PPO: `fabric.setup(agent)` returns a wrapper whose __getattr__ forwards
    `agent.get_action_and_value(x)`: the wrapper is never called, its submodules are. Forwards, samples/s and the
    rollout share are still seen."""
    if importlib.util.find_spec("lightning_fabric") is None:
        pytest.skip("lightning_fabric is not installed (a dev dependency: pip install -e .[dev])")
    # In a process of its own: importing lightning_fabric wraps torch.compile for the rest of the process.
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "trainfast", "doctor", "--steps", str(STEPS), "--warmup",
                           str(WARMUP), "--json", str(out), str(SCRIPTS / "fabric_rollout.py"), "--", "--threads", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["seen"]["forwards"] > report["seen"]["optimizer_steps"] > 0, report["seen"]
    assert report["fractions"]["collection"] > 0.2, report["fractions"]
    assert_rate_agrees(report, done.stdout, CYCLE_TOLERANCE, lines=1)


NEVER_STEPS = """
import sys
import time

import torch
from torch import nn

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
started = time.monotonic()
with torch.no_grad():
    while True:  # evaluation forever: no backward, no optimizer, never a step
        model(torch.randn(8, 32))
        time.sleep(0.01)
        if time.monotonic() - started > 40:  # a backstop for a doctor that never stops it
            sys.exit(7)
"""


@pytest.mark.slow
def test_a_script_that_never_steps_is_stopped_at_the_budget(tmp_path: Path) -> None:
    script = tmp_path / "never_steps.py"
    script.write_text(textwrap.dedent(NEVER_STEPS))
    started = time.monotonic()
    run = run_doctor(str(script), steps=10, warmup=2, max_seconds=3)
    elapsed = time.monotonic() - started
    report = run.report.to_json()
    assert elapsed < 15, f"the doctor took {elapsed:.1f} s to end a 3 s budget ({report['script']['outcome']})"
    assert "budget" in report["script"]["outcome"], report["script"]["outcome"]
    assert run.exit_code == 0
    assert report["verdict"] is None and report["steps_measured"] == 0
    assert report["data_wait_fraction"] is None  # not measured: null, never 0.0
    assert report["samples_per_s"] is None
    assert report["seen"]["backwards"] == 0 and report["seen"]["optimizer_steps"] == 0
    assert report["seen"]["forwards"] > 0, report["seen"]  # what it did see: the model ran
