"""`trainfast tune` end to end on tiny data, and `trainfast train --workers tuned` reading its result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfast.cli import main


def test_tune_then_train_with_the_tuned_loader(tiny_images: Path, cache_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune.json"
    common = ["--data", str(tiny_images), "--image-size", "16", "--batch-size", "8"]
    assert main(["tune", *common, "--model", "mlp", "--budget-s", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"chosen", "chosen_samples_per_s", "baseline_samples_per_s", "trials", "sweep_seconds"} <= set(result)
    for trial in result["trials"]:
        assert {"config", "samples_per_s", "seconds"} <= set(trial)
    printed = capsys.readouterr().out
    assert "◀ chosen" in printed and "x the baseline" in printed
    assert f"against auto: {result['kept_reason']}" in printed.replace("\n", " ")
    assert main(["train", *common, "--model", "mlp", "--workers", "tuned", "--epochs", "1", "--no-progress",
                 "--json", str(tmp_path / "train.json")]) == 0
    assert json.loads((tmp_path / "train.json").read_text())["steps"] == 80 // 8


@pytest.mark.parametrize(("argv", "message"), [
    (["tune", "--budget-s", "0"], "--budget-s 0.0 is not valid"),
    (["tune", "--data", "/nonexistent/x"], "does not exist"),
    (["tune", "--device", "tpu"], "device='tpu' is not valid"),
])
def test_tune_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                        tiny_images: Path) -> None:
    if "--data" not in argv:
        argv = [*argv, "--data", str(tiny_images)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_chosen_mark_survives_a_long_label(tiny_images: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from trainfast.cli import tune as tune_cli
    from trainfast.loader.tuned import WorkerSettings
    from trainfast.tune.result import TuneResult
    from trainfast.tune.trial import Trial

    # at 80 columns this label's mark used to wrap between "◀" and "chosen", and the summary inside "x the baseline"
    chosen = WorkerSettings(1, 4, False, 1, backend="threads")
    trials = [Trial(WorkerSettings(0), 100.0, 1.0, 8), Trial(chosen, 300.0, 2.0, 40)]
    monkeypatch.setattr(tune_cli, "tune_loader", lambda *a, **k: TuneResult(chosen, 300.0, WorkerSettings(0), 100.0,
                                                                            trials, 3.0, "k"))
    assert main(["tune", "--data", str(tiny_images), "--image-size", "16", "--batch-size", "8", "--model", "mlp"]) == 0
    printed = capsys.readouterr().out
    assert "◀ chosen" in printed and "3.00x the baseline" in printed
