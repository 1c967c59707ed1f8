"""`trainfast compare BASE NEW` through `trainfast.cli.main`: exit 0 / 1 / 2 / 3, the table and the verdict line, the
JSON, and bad arguments (made-up reports: no script runs)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from trainfast.cli import main


def report(*, step_s: float = 0.010, seed: int = 1, rows: int = 30, spread: float = 0.05, **extra: Any
           ) -> dict[str, Any]:
    """A window report of `rows` steps of about `step_s` seconds, 32 samples each."""
    rng = random.Random(seed)
    timeline, end = [], 0.0
    for _ in range(rows):
        total = step_s * max(0.2, rng.gauss(1.0, spread))
        end += total
        timeline.append({"end_s": end, "total_s": total, "wait_s": 0.1 * total, "transfer_s": 0.0,
                         "host_s": 0.0, "collect_s": 0.0, "compute_s": 0.9 * total, "samples": 32, "syncs": 0})
    return {"samples_per_s": 32 * rows / end, "timeline": timeline, "whole_run": None, "world_size": 1,
            "script": {"target": "train.py", "args": [], "exit_code": 0}, "loaders": [{"batch_size": 32}]} | extra


def whole_run(*, per_sample: float = 0.001, seed: int = 1) -> dict[str, Any]:
    """A whole-run report: 20 throughput intervals of 10 steps at about `per_sample` seconds a sample, 2 s of
    startup."""
    rng = random.Random(seed)
    throughput = []
    for i in range(20):
        seconds = 320 * per_sample * rng.gauss(1.0, 0.03)
        throughput.append({"start_s": 2.0 + i, "end_s": 2.0 + i + seconds, "steps": 10, "samples": 320,
                           "samples_per_s": 320 / seconds, "step_s": seconds / 10, "data_wait_s": 0.1 * seconds / 10,
                           "transfer_s": 0.0, "host_s": 0.0, "compute_s": 0.9 * seconds / 10})
    train = sum(320 / t["samples_per_s"] for t in throughput)
    wall = 2.0 + train
    phases = [{"phase": "startup", "seconds": 2.0, "share": 2.0 / wall},
              {"phase": "train", "seconds": train, "share": train / wall}]
    return report(seed=seed) | {"whole_run": {
        "wall_s": wall, "phases": phases, "goodput": train / wall, "seconds_per_sample": wall / 6400,
        "train": {"steps": 200, "samples": 6400, "samples_per_s": 6400 / train}, "throughput": throughput}}


def write(path: Path, payload: Any) -> str:
    path.write_text(json.dumps(payload))
    return str(path)


@pytest.fixture
def reports(tmp_path: Path) -> dict[str, str]:
    return {"base": write(tmp_path / "base.json", report(seed=1)),
            "same": write(tmp_path / "same.json", report(seed=2)),
            "slower": write(tmp_path / "slower.json", report(seed=2, step_s=0.0115)),
            "noisy": write(tmp_path / "noisy.json", report(seed=1, spread=0.6, rows=12)),
            "noisy2": write(tmp_path / "noisy2.json", report(seed=2, spread=0.6, rows=12)),
            "other": write(tmp_path / "other.json", report(seed=2, script={"target": "eval.py", "args": []}))}


def verdict(out: str) -> str:
    return [line for line in out.splitlines() if "→ exit" in line][-1]


def test_one_report_a_side_of_the_same_script_cannot_tell_and_exits_3(reports: dict[str, str],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--fail-slower", "5", reports["base"], reports["same"]]) == 3
    out = capsys.readouterr().out
    for row in ("samples/s", "step (mean)", "data wait / step", "compute / step", "base.json", "same.json"):
        assert row in out
    assert "transfer" not in out  # 0 in both
    line = verdict(out)
    assert line.startswith("warning: cannot tell: NEW is") and "one run a side cannot show the spread" in line
    assert "runs a side would tell a 5 % change" in line and line.endswith("→ exit 3")
    # options after the reports, as every command takes them; a CI that must choose
    assert main(["compare", reports["base"], reports["same"], "--fail-slower", "5", "--inconclusive", "pass"]) == 0
    assert main(["compare", reports["base"], reports["same"], "--fail-slower", "5", "--inconclusive=fail"]) == 1


def test_15_percent_slower_one_a_side_is_never_exit_1_but_twice_as_slow_is(
        reports: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--fail-slower", "5", reports["base"], reports["slower"]]) == 3
    twice = write(tmp_path / "twice.json", report(seed=2, step_s=0.020))
    assert main(["compare", "--fail-slower", "5", reports["base"], twice]) == 1
    line = verdict(capsys.readouterr().out)
    assert line.startswith("NEW is 9") and "% slower (interval " in line
    assert line.endswith(": more than --fail-slower 5 % → exit 1")
    assert main(["compare", "--fail-slower", "150%", reports["base"], twice]) != 1
    assert main(["compare", reports["base"], twice]) == 0  # no gate without --fail-slower
    assert "no --fail-slower given → exit 0" in verdict(capsys.readouterr().out)


def test_the_json(reports: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp.json"
    twice = write(tmp_path / "twice.json", report(seed=2, step_s=0.020))
    assert main(["compare", "--fail-slower", "5", "--json", str(out), reports["base"], twice]) == 1
    payload = json.loads(out.read_text())
    assert payload["base"] == reports["base"] and payload["new"] == twice
    assert payload["kind"] == "window" and payload["measure"]["name"] == "samples/s"
    assert payload["slowdown"]["interval_pct"][0] > 5
    assert [p["name"] for p in payload["parts"]] == ["step", "data wait", "compute"]
    gate = payload["gate"]
    assert {k: gate[k] for k in ("fail_slower_pct", "decided", "failed", "exit_code", "inconclusive")} == {
        "fail_slower_pct": 5.0, "decided": True, "failed": True, "exit_code": 1, "inconclusive": "exit"}
    assert gate["verdict"] == verdict(capsys.readouterr().out) and gate["decision"]["verdict"] == "slower"
    assert payload["speeds"]["base"] == [pytest.approx(payload["measure"]["base"])]


def test_whole_runs_gate_on_wall_time_per_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write(tmp_path / "base.json", whole_run(seed=1))
    same, slower = (write(tmp_path / "same.json", whole_run(seed=2)),
                    write(tmp_path / "slower.json", whole_run(seed=2, per_sample=0.00118)))
    assert main(["compare", "--fail-slower", "5", base, same]) == 3
    out = capsys.readouterr().out
    for row in ("whole-run reports", "wall time per sample", "train samples/s", "phase: startup", "goodput",
                "from 19 and 19 throughput"):
        assert row in out
    assert main(["compare", "--fail-slower", "5", base, slower]) == 3  # one a side: within what drift can be
    assert "% slower in wall time per sample (interval " in verdict(capsys.readouterr().out)
    assert main(["compare", base, write(tmp_path / "window.json", report())]) == 2
    assert f"BASE ({base}) is a whole-run report" in capsys.readouterr().err


@pytest.mark.parametrize("case, why", [
    ("other", "different scripts: BASE ({base}) ran train.py with no arguments, NEW ({new}) ran eval.py"),
    ("list", "NEW ({new}) is not a trainfast doctor report (a JSON list, not an object)"),
    ("few", "NEW ({new}) has 3 measured steps; at least 10 are needed"),
    ("missing", "cannot read NEW ({new}): No such file or directory"),
    ("broken", "NEW ({new}) is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
])
def test_reports_that_cannot_be_compared_exit_2_in_one_line(case: str, why: str, reports: dict[str, str],
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    new = {"other": reports["other"], "list": write(tmp_path / "list.json", [1]),
           "few": write(tmp_path / "few.json", report(rows=3)), "missing": str(tmp_path / "nothing.json"),
           "broken": str(tmp_path / "broken.json")}[case]
    (tmp_path / "broken.json").write_text("not json")
    out = tmp_path / "cmp.json"
    assert main(["compare", "--fail-slower", "5", "--json", str(out), reports["base"], new]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainfast compare: error: ")
    assert why.format(base=reports["base"], new=new) in err[0]
    assert not out.exists()


@pytest.mark.parametrize("value, said", [("0", "0 is not valid"), ("-3", "-3 is not valid"),
                                         ("abc", "'abc' is not a number"), ("nan", "nan is not valid")])
def test_a_bad_fail_slower_is_refused_with_the_value_and_the_fix(value: str, said: str, reports: dict[str, str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["compare", f"--fail-slower={value}", reports["base"], reports["same"]])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "give a percentage above 0, e.g. --fail-slower 5" in err


def test_json_to_a_folder_is_refused(reports: dict[str, str], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["compare", "--json", str(tmp_path), reports["base"], reports["same"]])
    assert caught.value.code == 2 and "is a folder" in capsys.readouterr().err


def test_help_has_worked_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["compare", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert "trainfast compare --runs 3 --fail-slower 5 old_train.py train.py -- --epochs 1" in out
    assert "Exit codes:" in out and "3 cannot tell" in out
    assert "trainfast compare --fail-slower 5 'base-*.json' 'new-*.json'" in out and "--runs 3" in out


def test_several_reports_a_side_by_pattern(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(3):
        write(tmp_path / f"base-{i}.json", report(seed=10 + i))
        write(tmp_path / f"same-{i}.json", report(seed=20 + i))
        write(tmp_path / f"slow-{i}.json", report(seed=30 + i, step_s=0.0115))
    assert main(["compare", "--fail-slower", "5", "--json", str(tmp_path / "c.json"), str(tmp_path / "base-*.json"),
                 str(tmp_path / "same-*.json")]) in (0, 3)
    out = " ".join(capsys.readouterr().out.split())
    assert "in 3 and 3 runs, the runs resampled too" in out and "3 runs (mean)" in out
    assert "comparable: machine: the same in all 6 runs" in out and "comparable: other processes: quiet" in out
    saved = json.loads((tmp_path / "c.json").read_text())
    assert len(saved["base"]) == 3 and saved["runs"] == {"base": 3, "new": 3}
    assert main(["compare", "--fail-slower", "5", str(tmp_path / "base-*.json"), str(tmp_path / "slow-*.json")]) == 1
    assert "slower" in verdict(capsys.readouterr().out)


def test_a_pattern_that_matches_nothing_exits_2_naming_it(reports: dict[str, str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", reports["base"], str(tmp_path / "nothing-*.json")]) == 2
    err = capsys.readouterr().err
    assert "NEW pattern" in err and "nothing-*.json" in err and "matches no file" in err


def test_run_options_without_runs_are_refused(reports: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["compare", "--whole-run", reports["base"], reports["same"]])
    assert caught.value.code == 2 and "--whole-run only go with --runs N" in capsys.readouterr().err
