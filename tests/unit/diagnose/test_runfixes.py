"""Fixes for a whole run's time outside its steps (fixes/run.py): ranked with the step fixes by their gain on the
run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.whole_trials import eval_trial
from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.evidence.wholerun import run_evidence
from trainfast.diagnose.fixes.notes import not_offered_on_the_run
from trainfast.diagnose.fixes.run import amdahl, run_fixes
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.records.ledger import EvalPass
from trainfast.diagnose.records.steps import Fractions, LoaderStats
from trainfast.diagnose.records.trials import Trial


def entry(**seconds: float) -> dict:
    """A whole-run entry of 100 s with these phases' seconds (the rest is train)."""
    phases = dict.fromkeys(("startup", "compile", "evaluation", "checkpoint", "epoch_start", "other"), 0.0)
    phases.update(seconds)
    phases["train"] = 100.0 - sum(phases.values())
    return {"wall_s": 100.0, "phases": [{"phase": p, "seconds": s, "share": s / 100} for p, s in phases.items()],
            "evaluation": {"passes": 10, "forwards": 400, "data_wait_s": 2.0},
            "checkpoint": {"writes": [{"background": False, "bytes": 10**9} for _ in range(4)], "blocking_s":
                           phases["checkpoint"]},
            "epoch_start": {"seconds": [1.0, 1.0, 1.0, 1.0]}}


def whole_run_fixes(whole: dict, step_fixes: list[Recommendation], *, trial: Trial | None,
                    loaders: list[LoaderStats], step_wait_s: float | None,
                    bandwidth: float | None) -> tuple[list[Recommendation], list[str]]:
    """The whole run's fixes (fixes/run.py) and the notes on what was timed and not offered, from an entry."""
    run = run_evidence(whole, loaders=loaders, trial=trial, bandwidth=bandwidth, step_wait_s=step_wait_s)
    e = Evidence(verdict="balanced", device="cpu", fractions=Fractions.of(total_s=1.0, wait_s=0.0, transfer_s=0.0,
                                                                          host_s=0.0), step_s=0.1, steps=10,
                 samples_per_s=100.0, syncs_per_step=0.0, cpus=2, loaders=tuple(loaders), run=run)
    return run_fixes(e, run, step_fixes), list(not_offered_on_the_run(e))


def loader(persistent: bool = False) -> LoaderStats:
    return LoaderStats(0, "DataLoader", "TensorDataset", 2, False, persistent, 2, 64, False, None, batches=100)


STEP_FIX = Recommendation("num_workers", "More workers", "why", "fix", 1.5, gain_basis="measured")


def faster(factor: float) -> Trial:
    return Trial("eval_autocast", "bfloat16 autocast + inference_mode", factor=factor, low=factor, high=factor,
                 rounds=7, faster_rounds=7 if factor > 1 else 0, base_s=0.01, value=("cpu", "bfloat16"))


def test_the_evaluation_fix_outranks_a_step_fix_when_evaluation_is_the_larger_share() -> None:
    recs, notes = whole_run_fixes(entry(evaluation=50), [STEP_FIX], trial=faster(2.0), loaders=[loader()],
                                  step_wait_s=0.01, bandwidth=None)
    ids = [r.id for r in recs]
    assert ids[0] == "eval_autocast" and ids.index("eval_autocast") < ids.index("num_workers")
    top = recs[0]
    # 48 s of evaluation compute (its 2 s of data wait stay) twice as fast: 100 / 76
    assert top.run_gain == pytest.approx(100 / 76) and top.gain_basis == "measured" and "autocast('cpu'" in top.fix
    step = next(r for r in recs if r.id == "num_workers")
    assert step.run_gain == pytest.approx(amdahl(0.5, 1.5)) and step.expected_gain == 1.5
    assert next(r for r in recs if r.id == "eval_less_often").gain_basis == "estimate" and not notes


def test_an_evaluation_precision_measured_slower_is_a_note_not_a_fix() -> None:
    recs, notes = whole_run_fixes(entry(evaluation=30), [], trial=faster(0.7), loaders=[], step_wait_s=None,
                                  bandwidth=None)
    assert "eval_autocast" not in [r.id for r in recs] and "0.70x" in notes[0] and "not faster" in notes[0]


def test_background_checkpoints_gain_the_blocking_time_less_a_copy_to_host_memory() -> None:
    recs, _ = whole_run_fixes(entry(checkpoint=10), [], trial=None, loaders=[], step_wait_s=None,
                              bandwidth=4e9)  # 4 GB written: a 1 s copy at 4 GB/s
    fix = next(r for r in recs if r.id == "async_checkpoint")
    assert fix.run_gain == pytest.approx(100 / 91) and "3.7 GiB" in fix.why and "1.00 s" in fix.why


def test_persistent_workers_from_the_measured_epoch_restarts() -> None:
    recs, _ = whole_run_fixes(entry(epoch_start=4), [], trial=None, loaders=[loader()], step_wait_s=0.1,
                              bandwidth=None)
    fix = next(r for r in recs if r.id == "persistent_workers")
    assert fix.run_gain == pytest.approx(100 / (100 - (3.0 - 0.3))) and fix.overrides == {"persistent_workers": True}
    kept, _ = whole_run_fixes(entry(epoch_start=4), [], trial=None, loaders=[loader(persistent=True)],
                              step_wait_s=0.1, bandwidth=None)
    assert "persistent_workers" not in [r.id for r in kept]  # already in use


def test_startup_and_compile_are_named_without_a_gain() -> None:
    recs, _ = whole_run_fixes(entry(startup=20, compile=5), [], trial=None, loaders=[], step_wait_s=None,
                              bandwidth=None)
    named = {r.id: r for r in recs}
    assert named["startup"].run_gain is None and "20.0 s" in named["startup"].why
    assert "compile cache" in named["compile"].why and [r.id for r in recs][-2:] == ["compile", "startup"]


def test_eval_trial_times_the_scripts_own_model_and_batch_and_restores_its_mode() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model.train()
    ledger = Ledger(process_start=0.0)
    ledger.passes.append(EvalPass(0.0, 1.0, forwards=3))
    ledger.eval_call = (model, (torch.randn(8, 16),), {})
    trial = eval_trial(ledger, (("cpu", "bfloat16"),))
    assert trial is not None and trial.factor is not None and trial.rounds >= 3 and trial.value == ("cpu", "bfloat16")
    assert model.training and ledger.eval_call is None
    # evaluation already under autocast, or training without it: nothing to try
    ledger.eval_call = (model, (torch.randn(8, 16),), {})
    assert eval_trial(ledger, ()) is None
    ledger.passes[0].autocast_forwards = 3
    assert eval_trial(ledger, (("cpu", "bfloat16"),)) is None


@pytest.mark.parametrize(("args", "says"), [
    (["--eval_interval=250", "--eval_iters=200"], ": --eval_interval=500 (now 250), or --eval_iters=100 (now 200)"),
    (["--do_eval", "--eval_steps", "500", "--lr", "3e-4"], ": --eval_steps 1000 (now 500)"),
    (["--Eval-Every", "3", "--eval-batches", "1"], ": --Eval-Every 6 (now 3)"),  # one batch cannot be halved
    (["data/", "--epochs", "3"], " (the script's own evaluation interval and batches per evaluation: its command line "
                                 "names neither)"),
])
def test_evaluating_less_often_names_the_scripts_own_settings(args: list[str], says: str) -> None:
    """Never another project's flags: the script's own, from its command line, doubled or halved."""
    run = run_evidence(entry(evaluation=30), loaders=[], trial=None, bandwidth=None, step_wait_s=None)
    e = Evidence(verdict="balanced", device="cpu", fractions=Fractions.of(total_s=1.0, wait_s=0.0, transfer_s=0.0,
                                                                          host_s=0.0), step_s=0.1, steps=10,
                 samples_per_s=100.0, syncs_per_step=0.0, cpus=2, run=run, script_args=tuple(args))
    fix = next(r for r in run_fixes(e, run, []) if r.id == "eval_less_often")
    assert fix.fix == f"evaluate every 2x as many steps, or on half the batches{says}"
    assert "nanoGPT" not in fix.fix
