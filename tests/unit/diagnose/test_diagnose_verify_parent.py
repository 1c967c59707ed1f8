"""`doctor --verify` from the parent's side: refused under torchrun (its children would inherit the rank's RANK,
WORLD_SIZE, MASTER_* and torchrun's store), the parent's device memory handed back before the children start, and
the fixes verified faster measured again together (the children's figures given)."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from trainfast.cli import main
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report import verify, verify_runs
from trainfast.diagnose.report.verify import verify_fixes

FIX = Recommendation("num_workers", "t", "w", "f", 1.5, overrides={"num_workers": 2})
# what torchrun gives each rank (tests/integration/test_doctor_torchrun.py runs the real one)
TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29511",
            "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.fixture
def under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)


class _Ran(Exception):
    pass


def test_cli_refuses_verify_under_torchrun_before_running_the_script(under_torchrun: None, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def run_doctor(*args: Any, **kwargs: Any) -> None:
        raise _Ran
    monkeypatch.setattr(importlib.import_module("trainfast.diagnose.run"), "run_doctor", run_doctor)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", "--verify", str(script)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--verify cannot run under torchrun (RANK=1, WORLD_SIZE=2" in err  # what, with the values seen
    assert "each inheriting RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT and torchrun's store" in err  # why
    assert f"trainfast doctor --verify {script}" in err and "without --verify" in err  # how


def test_cli_without_verify_still_runs_under_torchrun(under_torchrun: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def run_doctor(*args: Any, **kwargs: Any) -> None:
        raise _Ran
    monkeypatch.setattr(importlib.import_module("trainfast.diagnose.run"), "run_doctor", run_doctor)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(_Ran):
        main(["doctor", str(script)])


def test_verify_fixes_refuses_under_torchrun(under_torchrun: None, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"--verify cannot run under torchrun \(RANK=1, WORLD_SIZE=2"):
        verify_fixes(str(tmp_path / "train.py"), recommendations=[FIX], steps=5, warmup=1)


def test_a_single_process_with_a_hand_set_process_group_env_may_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK=0 WORLD_SIZE=1 MASTER_* set by hand is how a DDP script runs alone: each child then hosts its own."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)
    assert verify.torchrun_refusal("train.py", module=False) is None


def test_the_parent_frees_its_device_memory_before_the_first_child(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA caching allocator keeps what the measured run freed; the children need that memory. (No GPU here:
    torch.cuda reports an initialised CUDA and records the calls, as the parent on a GPU would make them.)"""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    collect = gc.collect

    def collected(*args: Any) -> int:
        events.append("gc")
        return collect(*args)
    monkeypatch.setattr(gc, "collect", collected)

    def run_child(label: str, overrides: Any, spec: Any, **kwargs: Any) -> dict[str, Any]:
        events.append(f"child {label}")
        return {"fix": label, "samples_per_s": 100.0, "error": None, "seconds": 0.0}
    monkeypatch.setattr(verify, "run_child", run_child)
    verify_fixes(str(tmp_path / "train.py"), recommendations=[FIX], steps=5, warmup=1)
    assert events == ["gc", "empty_cache", "child baseline", "child num_workers", "child baseline"]


def test_without_cuda_initialised_the_cache_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking CUDA anything would create a context (hundreds of MB) in a parent that never used the GPU."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("empty_cache without CUDA initialised"))
    monkeypatch.setattr(verify, "run_child", lambda label, *a, **k: {"fix": label, "samples_per_s": 1.0,
                                                                       "error": None, "seconds": 0.0})
    verify_fixes(str(tmp_path / "train.py"), recommendations=[FIX], steps=5, warmup=1)


def test_a_run_whose_spec_cannot_be_written_is_an_error_row_not_a_traceback(tmp_path: Path) -> None:
    workdir = tmp_path / "a-file"
    workdir.write_text("")  # writing under it raises a real OSError, as a full temporary folder would
    run = verify_runs.run_child("more workers", {"num_workers": 2}, {"target": "x.py"}, workdir=workdir, name="run000",
                               env={}, cwd=str(tmp_path), timeout_s=5)
    assert run["samples_per_s"] is None and run["fix"] == "more workers"
    assert run["error"].startswith(f"not run: its spec could not be written in {str(workdir)!r}"), run["error"]
    assert "TMPDIR" in run["error"]


def _children(rates: dict[str, list[float]]) -> Any:
    """Children whose samples/s are given per label, in turn (a label's list is used up run by run)."""
    left = {label: list(values) for label, values in rates.items()}

    def run_child(label: str, overrides: Any, spec: Any, **kwargs: Any) -> dict[str, Any]:
        return {"fix": label, "overrides": overrides, "samples_per_s": left[label].pop(0), "error": None,
                "seconds": 0.0}
    return run_child


@pytest.mark.parametrize(("together", "vanished", "undecided"), [
    ([152.0, 155.0], [], ["amp"]),  # 1.52x: 1.01x channels_last's alone, within two repeats' noise: cannot tell
    # 1.2x: decided under channels_last's 1.5x alone (amp took its gain), and amp's alone (1.19x) within the noise
    ([120.0, 122.0], ["amp"], ["channels_last"]),
])
def test_the_fixes_verified_faster_are_measured_together_and_a_fix_that_adds_nothing_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, together: list[float], vanished: list[str],
        undecided: list[str]) -> None:
    """channels_last 1.5x and bf16 1.2x alone, each decided faster; the set, against channels_last alone, is decided
    no faster (amp vanishes), or cannot be told from it (amp is undecided). A fix within the noise alone (threads)
    stays out of it. Each set run is measured against the baselines on either side of it; its overrides are the
    members' merged, the first-ranked's value kept."""
    fixes = [Recommendation("amp", "t", "w", "f", 1.3, overrides={"autocast": "bfloat16", "threads": 1}),
             Recommendation("channels_last", "t", "w", "f", 1.4, overrides={"memory_format": "channels_last",
                                                                           "threads": 2}),
             Recommendation("threads", "t", "w", "f", 1.1, overrides={"threads": 2})]
    monkeypatch.setattr(verify, "run_child", _children({
        "baseline": [100.0, 100.0, 100.0, 100.0, 100.0, 104.0], "amp": [120.0, 118.0], "channels_last": [150.0, 151.0],
        "threads": [101.0, 100.0], "set": together}))
    ranked, info = verify_fixes(str(tmp_path / "train.py"), recommendations=fixes, steps=5, warmup=1, repeats=2)
    assert [r.id for r in ranked] == ["channels_last", "amp", "threads"]
    entry = info["set"]
    assert entry["ids"] == ["channels_last", "amp"]
    assert entry["overrides"] == {"memory_format": "channels_last", "threads": 2, "autocast": "bfloat16"}
    assert entry["dropped"] == ["amp's threads=1 left out: channels_last, ranked above it, sets threads=2"]
    assert entry["min"] == pytest.approx(min(together[0] / 100, together[1] / 102))
    assert entry["measured_repeats"] == 2 and entry["decision"]["verdict"] == "faster"
    assert (entry["vanished"], entry["undecided"]) == (vanished, undecided)
    assert [r["fix"] for r in info["runs"]] == ["baseline", "amp", "channels_last", "threads", "baseline"] * 2 + [
        "set", "baseline"] * 2
    assert info["gains"]["threads"]["decision"]["verdict"] == "inconclusive"
    line = verify.set_line(entry)
    assert ("amp gained nothing in the set" in line) == bool(vanished)
    assert (f"cannot tell what {', '.join(undecided)} adds to the others in the set" in line) == bool(undecided)


def test_one_fix_verified_faster_is_its_own_set_and_costs_no_more_runs(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify, "run_child", _children({"baseline": [100.0, 100.0], "num_workers": [180.0]}))
    _, info = verify_fixes(str(tmp_path / "train.py"), recommendations=[FIX], steps=5, warmup=1)
    assert info["set"]["ids"] == ["num_workers"] and info["set"]["median"] == pytest.approx(1.8)
    assert len(info["runs"]) == 3 and "the set is num_workers" in verify.set_line(info["set"])


def test_every_run_warms_up_past_the_batches_its_own_workers_hold_in_flight(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """8 workers with 2 batches each in flight: measured before those drain, the window times the queue, not the
    workers' steady rate. A baseline without them keeps the warm-up asked for (waiting for another run's workers
    tripled its time on slow reads)."""
    assert verify.steady_warmup(5, {"num_workers": 4, "prefetch_factor": 4}) == 16
    assert verify.steady_warmup(5, {"pin_memory": True, "num_workers": 0}) == 5
    monkeypatch.setattr(verify, "run_child", _children({"baseline": [100.0, 100.0], "num_workers": [180.0]}))
    eight = Recommendation("num_workers", "t", "w", "f", 1.5, overrides={"num_workers": 8, "persistent_workers": True})
    _, info = verify_fixes(str(tmp_path / "train.py"), recommendations=[eight], steps=5, warmup=5)
    assert [(run["fix"], run["warmup"]) for run in info["runs"]] == [("baseline", 5), ("num_workers", 16),
                                                                     ("baseline", 5)]
