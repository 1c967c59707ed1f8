"""The zero-code doctor on unmodified scripts of every kind: verdicts, fixes, exit codes, nothing left patched."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from trainfast.cli import main
from trainfast.diagnose import run_doctor
from trainfast.diagnose.evidence.noise import CONTENTION_CORES

SCRIPTS = Path(__file__).parent / "scripts"

with contextlib.suppress(ImportError):  # Lightning wraps torch.compile on import: import it before the snapshots
    import pytorch_lightning  # noqa: F401


pytestmark = pytest.mark.usefixtures("nothing_left_patched")  # after every doctor run, the process as before it


def doctor(script: str, *args: str, steps: int = 10, warmup: int = 2) -> tuple[dict, object]:
    run = run_doctor(str(SCRIPTS / script), args=list(args), steps=steps, warmup=warmup)
    return run.report.to_json(), run


@pytest.mark.usefixtures("one_intra_op_thread")  # the step one core's work: decoding in the loop is the signal
def test_seeds_before_loop_is_input_bound_with_num_workers_first(tiny_images: Path) -> None:
    report, run = doctor("before_loop.py", str(tiny_images / "train"))
    assert run.exit_code == 0 and report["script"]["outcome"].startswith("stopped after 10 measured steps")
    assert report["verdict"] == "input-bound" and report["data_wait_fraction"] > 0.3
    top = report["recommendations"][0]
    assert top["id"] == "num_workers" and top["expected_gain"] > 1.2
    assert "num_workers=0" in top["why"] and "num_workers=" in top["fix"]
    ids = {r["id"] for r in report["recommendations"]}
    assert "decode_size" in ids and "host_sync" not in ids  # .item() every step: free on the CPU
    assert report["loaders"][0]["num_workers"] == 0 and report["loaders"][0]["dataset"] == "JpegDataset"
    assert report["samples_per_s"] > 0 and report["steps_measured"] == 10


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # more workers than cores: the fix
def test_following_the_num_workers_fix_raises_throughput(tiny_images: Path) -> None:
    """The measured throughput rises when the script is re-run with the recommended worker count. Each file's read
    waits 5 ms before its decode (slow storage): the workers' gain is the reads they overlap, which needs no free
    core. (On decoding alone, two runs compared one after the other on a machine whose cores other processes kept
    busy measured the gain of cores that were not there, and the noise of the load between the runs.)"""
    before, _ = doctor("before_loop.py", str(tiny_images / "train"), "--read-ms", "5", steps=20)
    fix = next(r for r in before["recommendations"] if r["id"] == "num_workers")["fix"]
    workers = re.search(r"num_workers=(\d+)", fix).group(1)
    assert "persistent_workers=True" in fix and int(workers) > 1
    after, _ = doctor("before_loop.py", str(tiny_images / "train"), "--read-ms", "5", "--workers", workers,
                      "--persistent-workers", steps=20)
    assert after["loaders"][0]["num_workers"] == int(workers)
    assert after["samples_per_s"] > 1.2 * before["samples_per_s"]
    # the loop waits for the loader in both runs (its model is tiny), so the share of time waiting stays high and
    # its order is noise; the wait per sample is what the fix cuts
    assert wait_per_sample(after) < wait_per_sample(before)


def wait_per_sample(report: dict) -> float:
    return report["data_wait_fraction"] / report["samples_per_s"]


def test_heavy_model_on_in_memory_tensors_is_compute_bound() -> None:
    report, _ = doctor("in_memory_heavy.py")
    assert report["verdict"] == "compute-bound"
    assert report["loaders"] == [] and report["input_source"] == "script"  # batches sliced by hand
    assert report["step_signal"] == "optimizer" and report["steps_measured"] == 10
    seconds = sum(step["total_s"] for step in report["timeline"])
    assert report["samples_per_s"] == pytest.approx(32 * 10 / seconds)  # from the model input's leading dimension
    assert all(step["samples"] == 32 for step in report["timeline"])
    # channels_last is timed on the model itself: recommended when measured faster, else named in a note
    trial = next(t for t in report["observed"]["trials"]["trials"] if t["id"] == "channels_last")
    assert trial["factor"] is not None and trial["rounds"] >= 3, trial
    assert ("channels_last" in {r["id"] for r in report["recommendations"]}
            or any(n.startswith("channels_last not recommended") for n in report["notes"])), report["notes"]
    assert "host_sync" not in {r["id"] for r in report["recommendations"]}  # AdamW's own .item() is not the script's


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_start_methods(tiny_images: Path, context: str) -> None:
    # one epoch of 10 batches: the script ends by itself, its workers shut down normally
    report, run = doctor("before_loop.py", str(tiny_images / "train"), "--workers", "2", "--context", context,
                         "--epochs", "1", steps=30)
    assert run.exit_code == 0 and report["script"]["outcome"] == "the script finished"
    assert report["loaders"][0]["num_workers"] == 2 and report["loaders"][0]["kind"] == f"DataLoader ({context})"
    assert report["steps_measured"] == 8 and report["verdict"] is not None
    assert any("only 8 of the 30 requested steps" in note for note in report["notes"])


def test_workers_restarted_every_few_steps_are_periodic_steps_not_noise() -> None:
    """A `cycle(loader)` generator re-iterates a loader of 2 workers that do not persist every 5 steps (a diffusion
    trainer's loop): each epoch's first step is slow, measured as such, and costed for persistent_workers from its
    excess, not from iter() to the first batch; no machine is blamed unless other processes used the CPU. Each
    worker's start waits 0.3 s (a sleep, as a dataset opening its files does): the restart's cost stands out of the
    other steps' spread however busy the cores are (the fork and the workers' CPU work alone were lost in it when
    other processes kept both cores busy: no period found)."""
    run = run_doctor(str(SCRIPTS / "cycle_loader.py"), args=["--per-epoch", "5", "--start-ms", "300"], steps=18,
                     warmup=2, probe_gains=False)
    report = run.report.to_json()
    assert run.exit_code == 0 and report["steps_measured"] == 18
    periodic, starts = report["observed"]["periodic"], report["observed"]["epoch_starts"]
    assert len(starts) >= 3 and {b - a for a, b in itertools.pairwise(starts)} == {5}, starts
    assert periodic is not None and periodic["epoch_starts"] and periodic["period"] == 5, (periodic, report["timeline"])
    assert periodic["steps"] == starts and periodic["excess_s"] > 0
    rec = next(r for r in report["recommendations"] if r["id"] == "persistent_workers")
    assert rec["gain_basis"] == "measured" and rec["expected_gain"] > 1.05, rec
    assert "each epoch's first" in rec["why"] and "beyond the other steps per epoch start" in rec["why"]
    notes = report["notes"]
    assert any(n.startswith("every 5th step (each epoch's first)") and "persistent_workers" in n for n in notes), notes
    contended = (report["contention"] or {}).get("other_cores_busy_mean", 0.0) >= CONTENTION_CORES
    assert contended or not any("quieter machine" in n for n in notes), (notes, report["contention"])


def test_sys_exit_is_reported_with_its_code() -> None:
    report, run = doctor("exits.py", warmup=1)
    assert run.exit_code == 3 and report["script"]["outcome"] == "the script called sys.exit(3)"
    assert report["steps_measured"] == 3  # 4 steps, 1 warm-up; its `except Exception` did not matter


def test_sys_exit_with_a_message_prints_it_as_python_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "quits.py"
    script.write_text("import sys, torch\nm = torch.nn.Linear(2, 1)\no = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for i in range(4):\n    m(torch.randn(4, 2)).sum().backward()\n    o.step()\n"
                      "sys.exit('no more data: stopping')\n")
    run = run_doctor(str(script), steps=10, warmup=1)  # the script ends first
    assert run.exit_code == 1 and "no more data: stopping" in capsys.readouterr().err


def test_a_process_group_the_stopped_script_opened_is_closed(tmp_path: Path) -> None:
    """Stopped mid-loop, the script never reaches destroy_process_group(): its port would stay bound (and
    --verify's runs of the same script fail with EADDRINUSE)."""
    script = tmp_path / "ddp.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:29581', rank=0, world_size=1)\n"
                      "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
                      "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for i in range(1000):\n    m(torch.randn(4, 2)).sum().backward()\n    o.step()\n"
                      "dist.destroy_process_group()\n")
    for _ in range(2):  # the second run binds the same port
        run = run_doctor(str(script), steps=3, warmup=1)
        assert run.exit_code == 0 and run.report.to_json()["steps_measured"] == 3
        assert not torch.distributed.is_initialized()


def test_crash_reports_what_was_measured_then_the_error() -> None:
    report, run = doctor("crashes.py", warmup=1)
    assert run.exit_code == 1 and report["steps_measured"] == 3
    assert report["script"]["outcome"] == "the script crashed: ValueError: the data ran out of unicorns"
    assert "Traceback" in run.error and "unicorns" in run.error


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # Lightning uses a pytree API torch 2.13 deprecates
def test_pytorch_lightning_script() -> None:
    pytest.importorskip("pytorch_lightning")
    report, run = doctor("lightning_script.py")
    assert run.exit_code == 0 and report["steps_measured"] == 10 and report["verdict"] is not None
    assert report["loaders"][0]["dataset"] == "TensorDataset"


@pytest.mark.usefixtures("one_intra_op_thread")
def test_cli_doctor_json_contract(tiny_images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    code = main(["doctor", "--steps", "5", "--warmup", "1", "--json", str(out), str(SCRIPTS / "before_loop.py"),
                 "--", str(tiny_images / "train"), "--epochs", "3"])
    assert code == 0
    report = json.loads(out.read_text())
    assert {"verdict", "data_wait_fraction", "steps_measured", "samples_per_s", "loaders", "recommendations",
            "env"} <= set(report)
    for rec in report["recommendations"]:
        assert {"id", "title", "why", "fix", "expected_gain"} <= set(rec)
    assert {"python", "torch", "checks"} <= set(report["env"])
    printed = capsys.readouterr().out
    assert "INPUT-BOUND" in printed and "num_workers" in printed


@pytest.mark.parametrize(("argv", "message"), [
    (["doctor"], "give a SCRIPT to run, or -m MODULE"),
    (["doctor", "missing.py"], "no script at 'missing.py'"),
    (["doctor", "--steps", "0", "x.py"], "argument --steps: 0 is not valid"),
    (["doctor", "--max-seconds", "0", "x.py"], "argument --max-seconds: 0 is not valid; give seconds > 0"),
    (["doctor", "--max-seconds", "soon", "x.py"], "argument --max-seconds: 'soon' is not a number"),
    (["doctor", "--verify-repeats", "0", "x.py"], "argument --verify-repeats: 0 is not valid"),
])
def test_cli_doctor_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_doctor_options_after_the_script_when_a_double_dash_ends_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "argv.py"
    script.write_text((SCRIPTS / "crashes.py").read_text().replace(
        'raise ValueError("the data ran out of unicorns")', "import sys; print('args', sys.argv[1:]); sys.exit(0)"))
    out = tmp_path / "r.json"
    assert main(["doctor", str(script), "--warmup", "1", "--json", str(out), "--", "--lr", "0.1"]) == 0
    captured = capsys.readouterr()
    assert "args ['--lr', '0.1']" in captured.out and out.is_file() and "warning" not in captured.err
    assert json.loads(out.read_text())["warmup_steps"] == 1
    assert main(["doctor", str(script), "--json", str(tmp_path / "s.json")]) == 0  # no --: all the script's
    captured = capsys.readouterr()
    assert f"args ['--json', '{tmp_path / 's.json'}']" in captured.out and not (tmp_path / "s.json").exists()
    assert "warning: --json after the script go to the script" in captured.err
    assert main(["doctor", str(script), "--debug", "-m", "x", "--", "--lr", "1"]) == 0  # not only the doctor's
    captured = capsys.readouterr()
    assert "args ['--debug', '-m', 'x', '--', '--lr', '1']" in captured.out and "warning" not in captured.err


def test_cli_doctor_module_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    package = tmp_path / "pkgdoc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text((SCRIPTS / "crashes.py").read_text().replace(
        'raise ValueError("the data ran out of unicorns")', "import sys; print('args', sys.argv[1:]); sys.exit(0)"))
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--warmup", "1", "-m", "pkgdoc.train", "--", "--lr", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "args ['--lr', '0.1']" in out and "the script called sys.exit(0)" in out
    sys.modules.pop("pkgdoc.train", None)
    sys.modules.pop("pkgdoc", None)
