"""`trainfast run --apply REPORT`: which fixes of a doctor report are applied (`fixes_to_apply`), the line that says
so, and the errors before the script starts (exit 2, one line): a report that cannot be read, a --fix that is not in
it, nothing to apply, an override this trainfast does not know. The runs themselves: tests/integration/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainfast.cli import main
from trainfast.diagnose.run.apply import (
    ApplyError,
    Fix,
    NothingToApply,
    Selection,
    describe,
    fixes_to_apply,
    load_report,
)
from trainfast.decide import FASTER


def fix(fix_id: str, gain: float | None = None, basis: str = "verified", **overrides: Any) -> dict[str, Any]:
    """A recommendation as the JSON report holds it (the fields `run --apply` reads, and a title)."""
    return {"id": fix_id, "title": fix_id, "measured_gain": gain, "gain_basis": basis,
            "overrides": overrides or None}


def report(*fixes: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"recommendations": list(fixes), **extra}


VERIFIED = report(
    fix("num_workers", 1.84, num_workers=4, persistent_workers=True),
    fix("threads", 1.02, threads=2),  # verified, but within the noise: not faster
    fix("pin_memory", FASTER, pin_memory=True),  # exactly the margin counts as faster
    fix("startup", None, basis="measured"),  # nothing to inject: it needs an edit
    fix("tf32", 1.5, basis="measured", tf32=True),  # measured in the run, never re-run by --verify
    fix("cudnn_benchmark", None, cudnn_benchmark=True),  # verified, but its re-run gave no figure
    verify={"set": {"ids": ["num_workers", "pin_memory"], "median": 1.9}},  # the fixes together: not a choice
)


def ids(selection: Selection) -> list[str]:
    return [f.id for f in selection.fixes]


def test_by_default_the_fixes_verified_faster_that_can_be_injected_in_the_reports_order() -> None:
    chosen = fixes_to_apply(VERIFIED)
    assert ids(chosen) == ["num_workers", "pin_memory"]
    assert chosen.overrides == {"num_workers": 4, "persistent_workers": True, "pin_memory": True}
    assert chosen.fixes[0] == Fix("num_workers", 1.84, {"num_workers": 4, "persistent_workers": True}, "verified")
    assert chosen.notes == chosen.warnings == ()


def test_a_fix_named_with_fix_is_applied_whatever_its_gain_with_a_warning_when_not_verified_faster() -> None:
    chosen = fixes_to_apply(VERIFIED, ["tf32", "threads", "num_workers", "threads"])
    assert ids(chosen) == ["num_workers", "threads", "tf32"]  # the report's order, once each
    assert chosen.overrides == {"num_workers": 4, "persistent_workers": True, "threads": 2, "tf32": True}
    assert chosen.warnings == (
        "fix threads measured 1.02x with --verify, not at least 1.03x as fast; applied as asked",
        "fix tf32 was never verified (run `trainfast doctor --verify` to measure it); applied as asked")


def test_two_fixes_setting_one_key_differently_the_higher_ranked_wins_and_a_note_says_so() -> None:
    chosen = fixes_to_apply(report(fix("num_workers", 1.8, num_workers=4, persistent_workers=True),
                                   fix("pin_memory", 1.2, num_workers=2, pin_memory=True),
                                   fix("prefetch", 1.1, num_workers=4, prefetch_factor=4)))
    assert chosen.overrides == {"num_workers": 4, "persistent_workers": True, "pin_memory": True,
                                "prefetch_factor": 4}
    # prefetch sets the same value: no conflict
    assert chosen.notes == ("pin_memory's num_workers=2 left out: num_workers, ranked above it, sets num_workers=4",)


def test_the_applying_line_names_each_fix_its_overrides_and_its_gain() -> None:
    selection = Selection((Fix("num_workers", 1.84, {"num_workers": 4, "persistent_workers": True}, "verified"),
                           Fix("channels_last", 1.31, {"memory_format": "channels_last"}, "verified")), {})
    assert describe(selection, "report.json") == (
        "applying 2 verified fix(es) from report.json: num_workers (num_workers=4, persistent_workers=True; "
        "verified 1.84x), channels_last (memory_format=channels_last; verified 1.31x)")
    chosen = fixes_to_apply(VERIFIED, ["threads", "tf32"])
    assert describe(chosen, "r.json") == ("applying 2 fix(es) from r.json: threads (threads=2; measured 1.02x), "
                                          "tf32 (tf32=True; never verified)")


@pytest.mark.parametrize(("wanted", "why"), [("nope", "--fix nope is not a fix in the report"),
                                             ("startup", "--fix startup needs an edit to the script")])
def test_fix_must_name_a_fix_of_the_report_that_can_be_injected(wanted: str, why: str) -> None:
    with pytest.raises(ApplyError) as caught:
        fixes_to_apply(VERIFIED, ["num_workers", wanted])
    assert str(caught.value).startswith(why)
    assert str(caught.value).endswith(
        "the fixes that can be applied: num_workers, threads, pin_memory, tf32, cudnn_benchmark")


def test_nothing_to_apply_says_why_and_the_way_out() -> None:
    with pytest.raises(NothingToApply) as caught:  # a report written without --verify
        fixes_to_apply(report(fix("num_workers", None, basis="measured", num_workers=2),
                              fix("startup", None, basis="estimate")))
    assert not caught.value.verified and caught.value.applicable == ("num_workers",)
    assert str(caught.value) == ("the report has no verified fix (it was written without --verify); measure the fixes "
                                 "first: trainfast doctor --verify --json REPORT SCRIPT; or apply one anyway with "
                                 "--fix ID (one of: num_workers)")
    with pytest.raises(NothingToApply) as caught:  # verified, none faster
        fixes_to_apply(report(fix("num_workers", 0.97, num_workers=2), fix("threads", 1.01, threads=1)))
    assert caught.value.verified
    assert str(caught.value) == ("no verified fix measured at least 1.03x as fast (num_workers measured 0.97x, "
                                 "threads measured 1.01x); or apply one anyway with --fix ID (one of: num_workers, "
                                 "threads)")
    with pytest.raises(NothingToApply, match=r"none has overrides\)$"):
        fixes_to_apply(report(fix("startup", 2.0)))
    with pytest.raises(NothingToApply):
        fixes_to_apply(report())


def test_an_override_this_trainfast_does_not_know_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^fix warp: unknown override 'warp_drive'; valid overrides: num_workers"):
        fixes_to_apply(report(fix("num_workers", 1.5, num_workers=2), fix("warp", 1.4, warp_drive=True)))
    with pytest.raises(ValueError, match=r"^fix num_workers: override num_workers=-1: give an integer >= 0"):
        fixes_to_apply(report(fix("num_workers", 1.5, num_workers=-1)))
    assert ids(fixes_to_apply(report(fix("num_workers", 1.5, num_workers=2), fix("warp", 1.0, warp_drive=True)))) == [
        "num_workers"]  # only the chosen fixes are checked


@pytest.mark.parametrize(("content", "why"), [
    (None, "no such file"), ("{not json", "not JSON"), ("[]", "not a trainfast doctor report"),
    ('{"verdict": "input_bound"}', 'not a trainfast doctor report (no "recommendations" list)')])
def test_a_report_that_cannot_be_read_says_so_with_its_path(tmp_path: Path, content: str | None, why: str) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ApplyError) as caught:
        load_report(path)
    assert str(caught.value).startswith(f"{path}: {why}")


def test_malformed_fixes_are_errors_not_crashes() -> None:
    with pytest.raises(ApplyError, match=r"recommendations\[1\] is not a fix"):
        fixes_to_apply(report(fix("a", 1.5, threads=1), {"title": "no id"}))
    with pytest.raises(ApplyError, match="fix 'a': its overrides are 3, not an object"):
        fixes_to_apply(report({"id": "a", "overrides": 3}))
    with pytest.raises(ApplyError, match="no \"recommendations\" list"):
        fixes_to_apply({"recommendations": None})


# ------------------------------------------------------------------------- the command: exit 2 before the script


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('the script must not run')\n")
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["run", *argv])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


def write(tmp_path: Path, content: dict[str, Any]) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(content))
    return path


def test_no_fix_to_apply_names_the_doctor_run_that_would_verify_them(tmp_path: Path, script: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, report(fix("num_workers", None, basis="measured", num_workers=2)))
    code, err = run_cli(capsys, "--apply", str(path), str(script), "--", "data dir", "--lr", "1")
    assert code == 2
    assert err == (f"trainfast run: error: {path}: the report has no verified fix (it was written without --verify); "
                   f"measure the fixes first: trainfast doctor --verify --json {path} {script} -- 'data dir' --lr 1; "
                   "or apply one anyway with --fix ID (one of: num_workers)\n")


@pytest.mark.parametrize(("content", "argv", "said"), [
    (None, (), "no such file"),
    ({"a": 1}, (), 'not a trainfast doctor report (no "recommendations" list)'),
    (VERIFIED, ("--fix", "nope"), "--fix nope is not a fix in the report; the fixes that can be applied: num_workers"),
    (report(fix("warp", 1.5, warp_drive=1)), (), "fix warp: unknown override 'warp_drive'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str],
                                          content: dict[str, Any] | None, argv: tuple[str, ...], said: str) -> None:
    path = write(tmp_path, content) if content is not None else tmp_path / "missing.json"
    code, err = run_cli(capsys, "--apply", str(path), *argv, str(script))
    assert code == 2
    assert err.startswith(f"trainfast run: error: {path}: {said}") and err.count("\n") == 1, err


def test_a_missing_script_or_report_flag_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--apply", "r.json"], ["--apply", "r.json", str(tmp_path / "absent.py")], [str(tmp_path)]):
        with pytest.raises(SystemExit) as caught:
            main(["run", *argv])
        assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "give a SCRIPT to run, or -m MODULE" in err and "no script at" in err
    assert "the following arguments are required: --apply" in err


def test_help_shows_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "trainfast doctor --verify --json report.json train.py -- data/" in out
    assert "torchrun --nproc-per-node 2 -m trainfast run --apply report.json train.py" in out
