"""`doctor --verify` from the parent's side: refused under torchrun (its children would inherit the rank's RANK,
WORLD_SIZE, MASTER_* and torchrun's store), and the parent's device memory handed back before the children start."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch

from trainfast.cli import main
from trainfast.diagnose.records.findings import Recommendation
from trainfast.diagnose.report import verify
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
    monkeypatch.setattr(verify, "_run_child", run_child)
    verify_fixes(str(tmp_path / "train.py"), recommendations=[FIX], steps=5, warmup=1)
    assert events == ["gc", "empty_cache", "child baseline", "child num_workers", "child baseline"]


def test_without_cuda_initialised_the_cache_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking CUDA anything would create a context (hundreds of MB) in a parent that never used the GPU."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: pytest.fail("empty_cache without CUDA initialised"))
    monkeypatch.setattr(verify, "_run_child", lambda label, *a, **k: {"fix": label, "samples_per_s": 1.0,
                                                                       "error": None, "seconds": 0.0})
    verify_fixes(str(tmp_path / "train.py"), recommendations=[FIX], steps=5, warmup=1)


def test_a_run_whose_spec_cannot_be_written_is_an_error_row_not_a_traceback(tmp_path: Path) -> None:
    workdir = tmp_path / "a-file"
    workdir.write_text("")  # writing under it raises a real OSError, as a full temporary folder would
    run = verify._run_child("more workers", {"num_workers": 2}, {"target": "x.py"}, workdir=workdir, name="run000",
                            env={}, cwd=str(tmp_path), timeout_s=5)
    assert run["samples_per_s"] is None and run["fix"] == "more workers"
    assert run["error"].startswith(f"not run: its spec could not be written in {str(workdir)!r}"), run["error"]
    assert "TMPDIR" in run["error"]
