"""`trainfast run --apply REPORT`: which fixes of a doctor report are applied (`fixes_to_apply`), the line that says
so, and the errors before the script starts (exit 2, one line): a report that cannot be read, a --fix that is not in
it, nothing to apply, an override this trainfast does not know. The runs themselves: tests/integration/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainfast.cli import main
from trainfast.decide import FASTER, Decision
from trainfast.diagnose.run.apply import (
    ApplyError,
    Fix,
    NothingToApply,
    Selection,
    describe,
    fixes_to_apply,
    load_report,
)

DIFFERS = "loss 4.1 with it against the baselines' 0.02 over steps 8-13: beyond the 0.05 their spread allows"


def decision(verdict: str, ratio: float) -> dict[str, Any]:
    """--verify's decision of a fix as the report's `verify.gains.<fix>.decision` holds it (trainfast.decide)."""
    return {"verdict": verdict, "ratio": ratio, "low": ratio / 1.25, "high": ratio * 1.25, "pairs": 1,
            "threshold": FASTER, "detectable": 1.25, "pairs_needed": 4, "confidence": 0.96, "sd": 0.07,
            "set_aside": 0}


def fix(fix_id: str, gain: float | None = None, basis: str = "verified", verdict: str | None = None,
        differs: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A recommendation as the JSON report holds it (the fields `run --apply` reads, and a title), with what
    --verify decided of it (`verdict`, `differs`: why it trains differently) for `report` to put in `verify.gains`."""
    rec = {"id": fix_id, "title": fix_id, "measured_gain": gain, "gain_basis": basis, "overrides": overrides or None}
    if verdict is not None and gain is not None:
        rec["gain"] = {"median": gain, "decision": decision(verdict, gain), "trains_same": differs is None,
                       "trains_differently": differs}
    return rec


def report(*fixes: dict[str, Any], **extra: Any) -> dict[str, Any]:
    recs = [{k: v for k, v in f.items() if k != "gain"} for f in fixes]
    gains = {f["id"]: f["gain"] for f in fixes if "gain" in f}
    if gains:
        extra["verify"] = extra.get("verify", {}) | {"gains": gains}
    return {"recommendations": recs, **extra}


VERIFIED = report(
    fix("num_workers", 1.84, verdict="faster", num_workers=4, persistent_workers=True),
    fix("threads", 1.02, verdict="inconclusive", threads=2),  # verified, but within the noise: not faster
    fix("pin_memory", FASTER, verdict="faster", pin_memory=True),  # the decision, not the ratio, says faster
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
    said = Decision(**decision("faster", 1.84)).said("the baseline", "it")
    assert chosen.fixes[0] == Fix("num_workers", 1.84, {"num_workers": 4, "persistent_workers": True}, "verified",
                                  "faster", said)
    assert chosen.notes == chosen.warnings == ()


def test_a_fix_that_trains_differently_is_applied_only_when_named_with_one_warning_and_both_losses() -> None:
    differs = report(fix("num_workers", 1.84, verdict="faster", differs=DIFFERS, num_workers=2,
                         persistent_workers=True),
                     fix("pin_memory", 1.3, verdict="faster", pin_memory=True))
    assert ids(fixes_to_apply(differs)) == ["pin_memory"]
    with pytest.raises(NothingToApply) as caught:
        fixes_to_apply(report(fix("num_workers", 1.84, verdict="faster", differs=DIFFERS, num_workers=2)))
    assert str(caught.value).startswith("no verified fix was decided at least 1.03x as fast and trains the same "
                                        f"(num_workers measured 1.84x, trains differently: {DIFFERS})")
    chosen = fixes_to_apply(differs, ["num_workers"])
    assert ids(chosen) == ["num_workers"]
    assert chosen.warnings == (f"fix num_workers trains differently: {DIFFERS}; applied as asked",)
    assert describe(chosen, "r.json") == ("applying 1 fix(es) from r.json: num_workers (num_workers=2, "
                                          "persistent_workers=True; measured 1.84x, trains differently)")


def test_a_report_without_decisions_applies_nothing_by_default() -> None:
    """A report --verify wrote before it decided (a ratio, no `decision`): its ratio alone is no verdict."""
    old = report(fix("num_workers", 1.84, num_workers=2))
    with pytest.raises(NothingToApply, match=r"num_workers measured 1\.84x \(no decision: a report from an older"):
        fixes_to_apply(old)
    assert fixes_to_apply(old, ["num_workers"]).warnings == (
        "fix num_workers measured 1.84x with --verify, which decided nothing of it (a report from an older "
        "trainfast: re-run trainfast doctor --verify); applied as asked",)


def test_a_fix_named_with_fix_is_applied_whatever_its_gain_with_a_warning_when_not_verified_faster() -> None:
    chosen = fixes_to_apply(VERIFIED, ["tf32", "threads", "num_workers", "threads"])
    assert ids(chosen) == ["num_workers", "threads", "tf32"]  # the report's order, once each
    assert chosen.overrides == {"num_workers": 4, "persistent_workers": True, "threads": 2, "tf32": True}
    said = Decision(**decision("inconclusive", 1.02)).said("the baseline", "it")
    assert said.startswith("cannot tell it from the baseline at 1.03x")
    assert chosen.warnings == (
        f"fix threads is not decided at least 1.03x as fast by --verify ({said}); applied as asked",
        "fix tf32 was never verified (run `trainfast doctor --verify` to measure it); applied as asked")


def test_two_fixes_setting_one_key_differently_the_higher_ranked_wins_and_a_note_says_so() -> None:
    chosen = fixes_to_apply(report(fix("num_workers", 1.8, verdict="faster", num_workers=4, persistent_workers=True),
                                   fix("pin_memory", 1.2, verdict="faster", num_workers=2, pin_memory=True),
                                   fix("prefetch", 1.1, verdict="faster", num_workers=4, prefetch_factor=4)))
    assert chosen.overrides == {"num_workers": 4, "persistent_workers": True, "pin_memory": True,
                                "prefetch_factor": 4}
    # prefetch sets the same value: no conflict
    assert chosen.notes == ("pin_memory's num_workers=2 left out: num_workers, ranked above it, sets num_workers=4",)


def test_the_applying_line_names_each_fix_its_overrides_and_its_gain() -> None:
    selection = Selection((Fix("num_workers", 1.84, {"num_workers": 4, "persistent_workers": True}, "verified",
                               "faster"),
                           Fix("channels_last", 1.31, {"memory_format": "channels_last"}, "verified", "faster")), {})
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
        fixes_to_apply(report(fix("num_workers", 0.97, verdict="slower", num_workers=2),
                              fix("threads", 1.01, verdict="inconclusive", threads=1)))
    assert caught.value.verified
    assert str(caught.value) == ("no verified fix was decided at least 1.03x as fast and trains the same "
                                 "(num_workers measured 0.97x (slower); threads measured 1.01x (cannot tell)); or "
                                 "apply one anyway with --fix ID (one of: num_workers, threads)")
    with pytest.raises(NothingToApply, match=r"none has overrides\)$"):
        fixes_to_apply(report(fix("startup", 2.0)))
    with pytest.raises(NothingToApply):
        fixes_to_apply(report())


def test_an_override_this_trainfast_does_not_know_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^fix warp: unknown override 'warp_drive'; valid overrides: num_workers"):
        fixes_to_apply(report(fix("num_workers", 1.5, verdict="faster", num_workers=2),
                              fix("warp", 1.4, verdict="faster", warp_drive=True)))
    with pytest.raises(ValueError, match=r"^fix num_workers: override num_workers=-1: give an integer >= 0"):
        fixes_to_apply(report(fix("num_workers", 1.5, verdict="faster", num_workers=-1)))
    assert ids(fixes_to_apply(report(fix("num_workers", 1.5, verdict="faster", num_workers=2),
                                     fix("warp", 1.0, verdict="same", warp_drive=True)))) == [
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
    (report(fix("warp", 1.5, verdict="faster", warp_drive=1)), (), "fix warp: unknown override 'warp_drive'"),
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
