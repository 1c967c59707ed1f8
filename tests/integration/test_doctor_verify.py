"""`trainfast doctor --verify` on the seeds' slow loop: each fix re-run in a fresh process, its gain measured."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from trainfast.cli import main
from trainfast.diagnose.recommend import Recommendation
from trainfast.diagnose.verify import verify_fixes

SCRIPTS = Path(__file__).parent / "scripts"


def test_verify_fixes_measures_more_workers_on_the_slow_loop(tiny_images: Path) -> None:
    fix = Recommendation("num_workers", "Load batches in 2 worker processes (now 0)", "decode in the main process",
                         "DataLoader(..., num_workers=2, persistent_workers=True); torch.set_num_threads(1)", 1.5,
                         overrides={"num_workers": 2, "persistent_workers": True, "threads": 1})
    manual = Recommendation("decode_size", "Decode JPEGs at the size you train at", "why", "fix", None)
    lines: list[str] = []
    ranked, info = verify_fixes(str(SCRIPTS / "before_loop.py"), args=[str(tiny_images / "train")],
                                recommendations=[manual, fix], steps=10, warmup=2, max_seconds=60.0,
                                progress=lines.append)
    assert [r.id for r in ranked] == ["num_workers", "decode_size"]
    assert ranked[0].measured_gain is not None and ranked[0].measured_gain > 1.1, info
    assert ranked[1].measured_gain is None
    runs = info["runs"]
    assert [r["fix"] for r in runs] == ["baseline", "num_workers", "baseline"]
    assert all(r["error"] is None and r["exit_code"] == 0 for r in runs), runs
    assert [loader["num_workers"] for loader in runs[0]["loaders"]] == [0]
    fixed = runs[1]["loaders"]
    assert [(loader["num_workers"], loader["persistent_workers"]) for loader in fixed] == [(2, True)]
    assert info["gains"]["num_workers"]["median"] == pytest.approx(ranked[0].measured_gain)
    assert len(info["baseline_samples_per_s"]) == 2 and info["seconds"] > 0
    assert any("num_workers" in line and "samples/s" in line for line in lines)


def test_cli_doctor_verify_writes_measured_gains(tiny_images: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = main(["doctor", "--verify", "--steps", "8", "--warmup", "2", "--max-seconds", "60", "--json", str(out),
                 str(SCRIPTS / "before_loop.py"), "--", str(tiny_images / "train")])
    assert code == 0
    report = json.loads(out.read_text())
    verify = report["verify"]
    assert verify is not None and verify["repeats"] == 1
    verifiable = [r for r in report["recommendations"] if r["overrides"]]
    for rec in verifiable:
        assert rec["measured_gain"] is not None, verify["gains"][rec["id"]]
    assert set(verify["gains"]) == {r["id"] for r in verifiable}
    assert len(verify["runs"]) == (len(verifiable) + 2 if verifiable else 0)
    captured = capsys.readouterr()
    assert "verify 1/" in captured.err if verifiable else "nothing to re-run" in captured.err
    if verifiable:
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
    monkeypatch.setattr(importlib.import_module("trainfast.diagnose.runner"), "run_doctor", fake_run_doctor)
    with pytest.raises(_Called) as called:
        main(["doctor", "--max-seconds", "12.5", str(SCRIPTS / "before_loop.py")])
    assert called.value.args[0]["max_seconds"] == 12.5
