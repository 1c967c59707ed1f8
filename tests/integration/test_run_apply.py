"""`trainfast run --apply REPORT SCRIPT`: real runs of tiny scripts with a hand-written report. The fix reaches the
DataLoader the script builds, the script's argv, stdout and exit code are its own, `-m` runs a module, the overrides
are taken back however the script ends, and under torchrun every rank applies the fix while rank 0 alone says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from trainfast.cli import main
from trainfast.diagnose.capture import inject

LIMIT_S = 60  # a 2-rank job starts in 5-10 s here (two interpreters importing torch, the rendezvous)
pytestmark = pytest.mark.timeout(LIMIT_S + 30)

LOADER = """\
import sys
from torch.utils.data import DataLoader

loader = DataLoader(range(8), batch_size=2)
print("num_workers", loader.num_workers, "persistent", loader.persistent_workers, "argv", sys.argv[1:])
"""
WORKERS = {"id": "num_workers", "title": "Load batches in 2 worker processes (now 0)", "expected_gain": 1.9,
           "measured_gain": 1.84, "gain_basis": "verified",
           "overrides": {"num_workers": 2, "persistent_workers": True}}
APPLYING = ("trainfast run: applying 1 verified fix(es) from {}: num_workers (num_workers=2, persistent_workers=True; "
            "verified 1.84x)\n")


# what --verify decided of it (verify.gains.<fix>: trainfast.decide's decision, and how it trains)
DECIDED = {"num_workers": {"median": 1.84, "trains_same": True, "trains_differently": None, "decision": {
    "verdict": "faster", "ratio": 1.84, "low": 1.47, "high": 2.3, "pairs": 1, "threshold": 1.03, "detectable": 1.25,
    "pairs_needed": 4, "confidence": 0.96, "sd": 0.065, "set_aside": 0}}}


def write_report(tmp_path: Path, *fixes: dict[str, Any]) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"verdict": "input_bound", "recommendations": list(fixes or [WORKERS]),
                                "verify": {"gains": DECIDED}}))
    return path


def write_script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


@pytest.mark.slow
def test_the_fix_reaches_the_scripts_loader_its_stdout_and_argv_its_own(tmp_path: Path) -> None:
    """A fresh process, as a user runs it: the script prints the override; what trainfast says is on stderr."""
    report, script = write_report(tmp_path), write_script(tmp_path, LOADER)
    done = subprocess.run([sys.executable, "-m", "trainfast", "run", "--apply", str(report), str(script), "--",
                           "data/", "--lr", "0.1"], capture_output=True, text=True, timeout=LIMIT_S,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "num_workers 2 persistent True argv ['data/', '--lr', '0.1']\n"
    assert done.stderr == APPLYING.format(report)


def test_exit_codes_and_tracebacks_are_the_scripts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   nothing_left_patched: None) -> None:
    """In this process: sys.exit(n) -> n, sys.exit("message") -> 1 with the message, an exception -> 1 with its
    traceback from the script's own frame; the DataLoader and sys.argv/sys.path are put back each time."""
    report = write_report(tmp_path)
    original = DataLoader.__init__
    cases = {"sys.exit(3)": (3, ""), "sys.exit('no data')": (1, "no data\n"), "sys.exit()": (0, ""),
             "raise RuntimeError('boom')": (1, "RuntimeError: boom\n"), "raise KeyboardInterrupt": (130, "")}
    for i, (ending, (code, said)) in enumerate(cases.items()):
        script = write_script(tmp_path, LOADER + ending + "\n", f"ends_{i}.py")
        assert main(["run", "-q", "--apply", str(report), str(script)]) == code, ending
        captured = capsys.readouterr()
        assert captured.out == "num_workers 2 persistent True argv []\n"
        assert captured.err.endswith(said), captured.err
        assert DataLoader.__init__ is original
    script = write_script(tmp_path, LOADER + "raise RuntimeError('boom')\n", "crash.py")
    assert main(["run", "--apply", str(report), str(script)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(APPLYING.format(report) + "Traceback (most recent call last):\n  File "), err
    assert "runpy" not in err and "apply.py" not in err  # as `python crash.py` prints it: the script's frames
    assert f'{script}", line 6, in <module>' in err


def test_a_module_runs_as_with_python_m(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch, nothing_left_patched: None) -> None:
    """`-m MODULE -- ARGS`: found from the current folder, as `python -m` finds it, with a fix named by --fix that
    was never verified (a warning says so)."""
    write_script(tmp_path, LOADER + "import json_helper_for_run_apply\n", "run_apply_module_a.py")
    write_script(tmp_path, "print('the folder of the module is on sys.path')\n", "json_helper_for_run_apply.py")
    threads = {"id": "threads", "title": "t", "measured_gain": None, "gain_basis": "measured",
               "overrides": {"threads": 1}}
    report = write_report(tmp_path, WORKERS, threads)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "json_helper_for_run_apply", raising=False)
    try:
        code = main(["run", "--apply", str(report), "--fix", "threads", "-m", "run_apply_module_a", "--", "a", "b"])
    finally:
        sys.modules.pop("json_helper_for_run_apply", None)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == ("num_workers 0 persistent False argv ['a', 'b']\n"  # only --fix's: threads
                            "the folder of the module is on sys.path\n")
    assert "applying 1 fix(es) from" in captured.err and "threads (threads=1; never verified)" in captured.err
    assert "warning: fix threads was never verified" in captured.err


def test_what_happened_to_the_fixes_is_said_after_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`Injected.events` (a compile that fell back, ...), each one line after the script's output; also an event
    added as the overrides are taken back."""
    real = inject.apply_overrides

    @contextmanager
    def with_events(overrides: Mapping[str, Any]) -> Iterator[Any]:  # an Injected
        with real(overrides) as injected:
            injected.events.append("compile fell back to eager: a graph break")
            yield injected
            injected.events.append("taken back")
    monkeypatch.setattr(inject, "apply_overrides", with_events)
    script = write_script(tmp_path, LOADER)
    assert main(["run", "-q", "--apply", str(write_report(tmp_path)), str(script)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "num_workers 2 persistent True argv []\n"
    assert captured.err == "trainfast run: compile fell back to eager: a graph break\ntrainfast run: taken back\n"


DDP = """\
import os
import torch.distributed as dist
from torch.utils.data import DataLoader

dist.init_process_group("gloo")
loader = DataLoader(range(8), batch_size=2)
# one write for the whole line: unbuffered, print's pieces from two ranks interleaved ("rankrank 0 ...")
os.write(1, f"rank {dist.get_rank()} num_workers {loader.num_workers}\\n".encode())
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_under_torchrun_every_rank_applies_the_fix_and_rank_0_says_so_once(tmp_path: Path, torchrun: Any) -> None:
    report, script = write_report(tmp_path), write_script(tmp_path, DDP)
    done = torchrun("-m", "trainfast", "run", "--apply", str(report), str(script), timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 num_workers 2", "rank 1 num_workers 2"]
    assert (done.stdout + done.stderr).count("trainfast run: applying") == 1
