"""`trainfast doctor --verify` on the seeds' slow loop: each fix re-run in a fresh process, its gain measured."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from trainfast.cli import main

SCRIPTS = Path(__file__).parent / "scripts"


def test_cli_doctor_verify_measures_more_workers_on_the_slow_loop(tiny_images: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The doctor offers more loader workers (and a decode fix it cannot re-run) for the loop that decodes in the
    main process; --verify re-runs it with the fix between two unchanged runs, and the gain is measured.

    Each file's read waits 20 ms before its decode (slow storage), and the script runs its model on one intra-op
    thread: the main thread mostly waits, so more workers than cores are proposed (Little's law), and what they gain
    is the reads they overlap, which needs no free core. On the decode alone, with other processes busy on both
    cores, the 8-step runs measured 2 workers anywhere from 0.9x to 2.2x (and on two intra-op threads the tiny
    model's step took as long as the decode: one worker was proposed); with 5 ms reads the main thread's time queued
    for a core decided between 2 workers and 6."""
    out = tmp_path / "report.json"
    code = main(["doctor", "--verify", "--steps", "4", "--warmup", "1", "--max-seconds", "60", "--json", str(out),
                 str(SCRIPTS / "before_loop.py"), "--", str(tiny_images / "train"), "--read-ms", "20",
                 "--threads", "1"])
    assert code == 0
    report = json.loads(out.read_text())
    verify, recommendations = report["verify"], report["recommendations"]
    assert verify is not None and verify["repeats"] == 1
    verifiable = [r["id"] for r in recommendations if r["overrides"]]
    assert "num_workers" in verifiable and "decode_size" in {r["id"] for r in recommendations}, recommendations
    for rec in recommendations:  # every fix it could re-run is measured, and ranks above those it could not
        assert (rec["measured_gain"] is not None) == (rec["id"] in verifiable), rec
    assert [r["id"] for r in recommendations][:len(verifiable)] == verifiable
    workers = next(r for r in recommendations if r["id"] == "num_workers")
    assert workers["overrides"]["num_workers"] > 2 and "Little's law" in workers["why"]  # the reads wait: beyond cores
    gain = workers["measured_gain"]
    assert gain > 1.5 and verify["gains"]["num_workers"]["median"] == pytest.approx(gain, abs=1e-3), verify
    assert set(verify["gains"]) == set(verifiable)
    runs = verify["runs"]
    assert [r["fix"] for r in runs] == ["baseline", *verifiable, "baseline"]
    assert all(r["error"] is None and r["exit_code"] == 0 for r in runs), runs
    assert [loader["num_workers"] for loader in runs[0]["loaders"]] == [0]
    fixed = runs[1 + verifiable.index("num_workers")]["loaders"]
    assert [(loader["num_workers"], loader["persistent_workers"]) for loader in fixed] == [
        (workers["overrides"]["num_workers"], True)]
    assert len(verify["baseline_samples_per_s"]) == 2 and verify["seconds"] > 0
    captured = capsys.readouterr()
    assert any(line.startswith("verify ") and "num_workers: " in line and "samples/s" in line
               for line in captured.err.splitlines()), captured.err
    assert "measured" in captured.out


@pytest.mark.parametrize(("argv", "message"), [
    (["doctor", "--max-seconds", "0", "x.py"], "argument --max-seconds: 0 is not valid"),
    (["doctor", "--max-seconds", "soon", "x.py"], "argument --max-seconds: 'soon' is not a number"),
    (["doctor", "--verify-repeats", "0", "x.py"], "argument --verify-repeats: 0 is not valid"),
])
def test_cli_doctor_verify_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


class _Called(Exception):
    pass


def test_cli_doctor_passes_max_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run_doctor(target: str, **kwargs: object) -> None:
        raise _Called(kwargs)
    monkeypatch.setattr(importlib.import_module("trainfast.diagnose.run"), "run_doctor", fake_run_doctor)
    with pytest.raises(_Called) as called:
        main(["doctor", "--max-seconds", "12.5", str(SCRIPTS / "before_loop.py")])
    assert called.value.args[0]["max_seconds"] == 12.5
