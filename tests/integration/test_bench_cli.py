"""`trainfast bench` through its own argparse front: the files it writes, progress lines, bad input (exit 2)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

from trainfast.bench.demo import FULL, QUICK, DemoSpec
from trainfast.bench.sweeps import BenchSpec
from trainfast.cli import bench

TINY_SPEC = BenchSpec(demo=replace(QUICK, epochs=1), batch_size=16, image_size=32, worker_batches=4,
                      precision_steps=4, workers=(0, 1))


def bench_main(*argv: str) -> int:
    """What `trainfast bench ...` does once the integrator lists `bench` in cli.COMMANDS."""
    parser = argparse.ArgumentParser(prog="trainfast")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.register(sub)
    args = parser.parse_args(["bench", *argv])
    return int(args.run(args, args.command_parser))


def test_bench_writes_json_markdown_and_png(tiny_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "QUICK_BENCH", TINY_SPEC)
    monkeypatch.setenv("COLUMNS", "1000")  # rich folds a line at the console width, a long temporary path included
    out = tmp_path / "out"
    assert bench_main("--quick", "--data", str(tiny_images), "--json", str(out / "b.json"), "--markdown",
                      str(out / "b.md"), "--plot", str(out / "b.png")) == 0
    report = json.loads((out / "b.json").read_text())
    assert set(report) >= {"workers", "precision", "naive_vs_trainfast", "hardware"}
    assert {tuple(sorted(r)) for r in report["workers"]} == {tuple(sorted(report["workers"][0]))}
    assert set(report["workers"][0]) >= {"num_workers", "epoch_s", "samples_per_s", "data_wait_fraction", "util",
                                         "util_source"}
    assert set(report["precision"][0]) >= {"precision", "batch_size", "peak_mem_bytes", "samples_per_s", "oom",
                                           "mem_source"}
    assert [r["batch_size"] for r in report["precision"]] == [16, 16, 32, 32, 64, 64]
    assert set(report["naive_vs_trainfast"]) >= {"naive", "trainfast", "speedup"}
    assert report["command"] == f"trainfast bench --quick --data {tiny_images}"
    markdown = (out / "b.md").read_text()
    assert f"`trainfast bench --quick --data {tiny_images}`" in markdown
    assert "| num_workers | threads | epoch time | samples/s | data wait | CPU util |" in markdown
    assert "| precision | batch | peak memory (RSS growth) | samples/s | speed vs fp32 at same batch |" in markdown
    with Image.open(out / "b.png") as image:
        assert image.format == "PNG" and image.width >= 1000
    printed = capsys.readouterr().out
    assert "workers: num_workers=1" in printed and "precision: bf16-mixed batch 64" in printed  # progress lines
    assert "Loader workers" in printed and "Precision x batch size" in printed and "naive vs trainfast" in printed
    assert f"wrote {out / 'b.png'}" in printed


@pytest.mark.parametrize(("layout", "message"), [
    ("missing", "does not exist"),
    ("no-train", "has no 'train' folder"),
    ("empty-train", "no images"),
])
def test_bad_data_exits_2_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str,
                                          message: str) -> None:
    root = tmp_path / "data"
    if layout != "missing":
        root.mkdir()
    if layout == "empty-train":
        (root / "train" / "cats").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        bench_main("--quick", "--data", str(root))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and str(root) in err


def test_an_output_path_that_is_a_folder_exits_2_before_measuring(tiny_images: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main("--data", str(tiny_images), "--json", str(tmp_path))
    assert exit_info.value.code == 2 and f"--json {str(tmp_path)!r} is a folder" in capsys.readouterr().err


def test_plot_without_matplotlib_exits_2_with_the_install_command(tiny_images: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before refusing --plot")

    monkeypatch.setattr(bench, "run_bench", must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        bench_main("--data", str(tiny_images), "--plot", str(tmp_path / "b.png"))
    assert exit_info.value.code == 2 and "pip install trainfast[plot]" in capsys.readouterr().err


def test_help_has_worked_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main("--help")
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "trainfast bench --quick" in out and "--markdown" in out


def test_steps_sets_every_row_s_steps_and_is_in_the_command(tiny_images: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[BenchSpec, str]] = []

    def fake_bench(spec: BenchSpec, root: Path, *, progress: object, command: str) -> None:
        seen.append((spec, command))
        raise SystemExit(0)  # what is measured is run_bench's own tests' business

    monkeypatch.setattr(bench, "run_bench", fake_bench)
    with pytest.raises(SystemExit):
        bench_main("--quick", "--data", str(tiny_images), "--steps", "7")
    spec, command = seen[0]
    assert (spec.worker_batches, spec.precision_steps) == (7, 7) and spec.demo == QUICK
    assert command == f"trainfast bench --quick --data {tiny_images} --steps 7"
    assert "3 rows of 7 batches" in capsys.readouterr().out


@pytest.mark.parametrize("steps", ["3", "0", "x"])
def test_steps_that_leave_nothing_to_time_exit_2(steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main("--quick", "--steps", steps)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--steps" in err and steps in err, err
    if steps == "3":
        assert "the first 3 of each row are warm-up; give 4 or more" in err


def test_demo_epochs_replaces_the_spec_s_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainfast.cli import demo
    seen: list[DemoSpec] = []
    monkeypatch.setattr(demo, "run_demo", lambda spec, repeats: seen.append(spec) or {})
    parser = argparse.ArgumentParser(prog="trainfast")
    demo.register(parser.add_subparsers(dest="command", required=True))
    for argv in (["demo", "--quick", "--epochs", "2"], ["demo", "--quick"], ["demo", "--epochs", "1"]):
        args = parser.parse_args(argv)
        assert args.run(args, args.command_parser) == 0
    assert seen == [replace(QUICK, epochs=2), QUICK, replace(FULL, epochs=1)]


# The real `--quick` (demo data, default rows) runs end to end as the bench part of benchmarks/gpu.sh, whose
# report tests/integration/test_gpu_script.py checks (make stress; make test runs it smaller).
