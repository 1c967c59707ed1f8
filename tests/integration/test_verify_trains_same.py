"""`doctor --verify` asks of each fix "does it train the same" beside "is it faster": a curriculum the loop sets on
the dataset (scripts/curriculum.py: `ds.noise` lowered after every step, in the main process) is one more loader
workers would never see. The doctor notes the assignment (`loaders[].dataset_set_after_start`) and its workers fix
says so; verify finds the fix faster, but its loss stays where the first step's noise puts it while the baselines'
falls: trains differently, both losses said. The set and `trainfast run --apply` leave it out; `--fix num_workers`
applies it with one warning line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfast.cli import main

SCRIPTS = Path(__file__).parent / "scripts"
CURRICULUM = SCRIPTS / "curriculum.py"


@pytest.mark.slow
def test_verify_reports_the_workers_fix_faster_but_training_differently_and_run_apply_leaves_it_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """16 samples of ~3 ms of CPU a batch, made in the main process: 2 workers make them ~2x as fast on 2 cores.
    Two repeats: with one, baselines 53 % apart (the machine shared) left a 2.27x fix "cannot tell" (0.94-5.48x);
    two pairs and two baseline pairs decide 2x at such drift (~32 s here). The baselines' loss over steps 8-13 is
    ~0.05 (the noise is 2 x 0.6^8 = 0.03 by then, the model's own error the rest), the workers' ~4.5 (their copies
    keep the first step's noise of 2): 20-60 times the limit the baselines' own spread gives."""
    out = tmp_path / "report.json"
    code = main(["doctor", "--verify", "--verify-repeats", "2", "--steps", "12", "--warmup", "2", "--max-seconds",
                 "60", "--json", str(out), str(CURRICULUM)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["loaders"][0]["dataset_set_after_start"] == ["noise"]
    workers = next(r for r in report["recommendations"] if r["id"] == "num_workers")
    assert workers["changes_training"].startswith("the loop sets Noisy.noise after loader #0 started; worker "
                                                  "processes hold a copy of the dataset made when they start")
    gain = report["verify"]["gains"]["num_workers"]
    assert gain["decision"]["verdict"] == "faster", report["verify"]["runs"]
    assert gain["trains_same"] is False and gain["loss"]["same"] is False, gain
    loss = gain["loss"]
    assert loss["fix"] > 5 * loss["baseline"] and loss["fix"] - loss["baseline"] > 3 * loss["limit"], loss
    assert f"loss {loss['fix']:.4g} with it against the baselines' {loss['baseline']:.4g}" in gain[
        "trains_differently"]
    together = report["verify"]["set"]
    assert together is None or "num_workers" not in together["ids"]
    runs = report["verify"]["runs"]
    assert all(run["loss"] is not None and run["loss_steps"] for run in runs), runs
    err = capsys.readouterr().err
    assert any(line.startswith("verify: num_workers is faster (") and "but trains differently: loss" in line
               for line in err.splitlines()), err

    code = main(["run", "--apply", str(out), str(CURRICULUM), "--", "--steps", "20"])
    err = capsys.readouterr().err
    if code == 2:  # nothing else to apply: the line says why num_workers is not
        assert "num_workers measured" in err and "trains differently: loss" in err, err
    else:
        assert code == 0 and "num_workers (" not in err, err
    code = main(["run", "--apply", str(out), "--fix", "num_workers", str(CURRICULUM), "--", "--steps", "20"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    warnings = [line for line in captured.err.splitlines() if line.startswith("trainfast run: warning:")]
    assert len(warnings) == 1 and "fix num_workers trains differently: loss" in warnings[0], captured.err
    assert "trained 20 steps" in captured.out
