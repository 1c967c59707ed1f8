"""`trainfast <command>`'s own errors: one line on stderr, `trainfast <command>: error: <message>`, exit 2 for bad
input and 1 for a failure during the work, no traceback; a bug keeps its traceback; `--debug` shows it for all.
And `--on-bad-sample skip`: training goes on past a corrupt image and the summary and JSON count the skips."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from trainfast.cli import build_parser, error_message, main
from trainfast.cli import train as train_cli
from trainfast.data.decode import CorruptImageError
from trainfast.trainer.config import ConfigError

pytestmark = pytest.mark.timeout(120)


def make_images(root: Path, per_class: int, *, truncate: str | None = None) -> Path:
    """root/train/<a|b>/<i>.jpg: tiny JPEGs; `truncate` ("a/1.jpg") names one cut in half. Returns root."""
    for c, name in enumerate(("a", "b")):
        folder = root / "train" / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (24, 20), (40 * i, 120 * c, 90)).save(folder / f"{i}.jpg", quality=90)
    if truncate is not None:
        path = root / "train" / truncate
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return root


@pytest.fixture
def corrupt(tmp_path: Path) -> tuple[Path, Path]:
    """(data root, the truncated file): 6 images, one of them truncated; at batch size 2 every one is drawn once."""
    root = make_images(tmp_path / "data", 3, truncate="a/1.jpg")
    return root, root / "train" / "a" / "1.jpg"


def train_argv(root: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(root), "--epochs", "1", "--image-size", "16", "--batch-size", "2",
            "--limit-batches", "3", "--device", "cpu", "--precision", "32-true", "--no-progress", "--workers", "0",
            *extra]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


# --------------------------------------------------------------------------------------------- a corrupt image

@pytest.mark.parametrize("workers", ["0", "1"])
@pytest.mark.slow
def test_a_corrupt_image_exits_1_naming_the_file_and_the_skip_flag(corrupt: tuple[Path, Path], workers: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root, bad = corrupt
    assert main(train_argv(root, "--workers", workers)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err  # from a worker too: its traceback is not part of the message
    assert lines[0].startswith(f"trainfast train: error: cannot decode image {str(bad)!r}: "), lines[0]
    assert "--on-bad-sample skip" in lines[0]
    assert "Caught CorruptImageError" not in lines[0]


@pytest.mark.parametrize("workers", ["0", "1"])
def test_skip_trains_past_a_corrupt_image_and_counts_it(corrupt: tuple[Path, Path], workers: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    assert main(train_argv(corrupt[0], "--workers", workers, "--on-bad-sample", "skip", "--json", str(out))) == 0
    result = json.loads(out.read_text())
    # one epoch, 6 samples in 3 full batches: each index is drawn once, the truncated one is skipped once (in the
    # worker process with --workers 1: the count is shared memory, not the worker's own counter)
    assert result["skipped_samples"] == 1
    assert result["steps"] == 3
    captured = capsys.readouterr()
    assert "1 corrupt sample(s) skipped" in captured.out
    assert "Traceback" not in captured.err


def test_without_corrupt_images_skipped_samples_is_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, out = make_images(tmp_path / "data", 3), tmp_path / "run.json"
    assert main(train_argv(root, "--json", str(out))) == 0
    assert json.loads(out.read_text())["skipped_samples"] == 0
    assert "skipped" not in capsys.readouterr().out  # only said with --on-bad-sample skip


# ----------------------------------------------------------------------------------------------------- bad input

def test_a_dataset_smaller_than_one_batch_exits_2_with_one_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = make_images(tmp_path / "data", 1)  # 2 images
    assert main([*train_argv(root), "--batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err, err
    assert error_lines(err) == [f"trainfast train: error: --data {str(root)!r} has 2 training image(s), fewer than "
                                "one batch of --batch-size 4 (training drops an incomplete batch); give --batch-size "
                                "2 or less, or more images"]


def test_tune_on_a_dataset_smaller_than_one_batch_exits_2(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    root = make_images(tmp_path / "data", 1)
    assert main(["tune", "--data", str(root), "--batch-size", "4", "--image-size", "16", "--no-step"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert error_lines(err) == [f"trainfast tune: error: --data {str(root)!r} has 2 training image(s), fewer than "
                                "one batch of --batch-size 4; give --batch-size 2 or less, or more images"]


def test_tune_names_a_corrupt_image_and_the_skip_flag(corrupt: tuple[Path, Path], cache_dir: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    root, bad = corrupt
    assert main(["tune", "--data", str(root), "--batch-size", "2", "--image-size", "16", "--no-step",
                 "--budget-s", "5", "--device", "cpu"]) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"trainfast tune: error: cannot decode image {str(bad)!r}")
    assert "--on-bad-sample skip" in lines[0]


# ------------------------------------------------------------------------------------ bugs and --debug keep it all

class Boom:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def fit(self, *args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug, not an expected failure")


def test_an_unexpected_exception_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(train_cli, "Trainer", Boom)
    with pytest.raises(ZeroDivisionError, match="a bug"):  # propagates: Python prints its traceback
        main(train_argv(make_images(tmp_path / "data", 3)))
    assert error_lines(capsys.readouterr().err) == []


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_re_raises_an_expected_error(tmp_path: Path, where: str) -> None:
    argv = [*train_argv(make_images(tmp_path / "data", 1)), "--batch-size", "4"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(ConfigError, match="fewer than one batch"):
        main(argv)


@pytest.mark.slow
def test_as_a_process_one_line_without_debug_and_the_traceback_with_it(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "trainfast", *train_argv(make_images(tmp_path / "data", 1)), "--batch-size", "4"]
    env = os.environ | {"PYTHONWARNINGS": "ignore"}
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env)
    assert plain.returncode == 2, plain.stderr
    assert "Traceback" not in plain.stderr and len(error_lines(plain.stderr)) == 1, plain.stderr
    debug = subprocess.run([*argv, "--debug"], capture_output=True, text=True, timeout=90, env=env)
    assert debug.returncode == 1, debug.stderr  # Python's own exit status for an uncaught exception
    assert "Traceback (most recent call last)" in debug.stderr
    assert "trainfast.trainer.config.ConfigError: --data" in debug.stderr


# -------------------------------------------------------------------------------------------- flags and messages

def test_on_bad_sample_is_a_flag_of_train_and_tune_only() -> None:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert ("--on-bad-sample" in flags) == (name in ("train", "tune")), name
        assert "--debug" in flags, name
    args = build_parser().parse_args(["train"])
    assert args.on_bad_sample == "error" and args.debug is False
    assert build_parser().parse_args(["--debug", "env"]).debug is True
    assert build_parser().parse_args(["env", "--debug"]).debug is True


def test_a_bad_on_bad_sample_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--on-bad-sample", "ignore"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'ignore' (choose from 'error', 'skip')" in capsys.readouterr().err


def test_a_worker_s_error_is_its_own_message_without_the_worker_traceback() -> None:
    wrapped = CorruptImageError(
        "Caught CorruptImageError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n    raise ...\nOSError: image file is truncated\n\nThe above exception was the '
        "direct cause of the following exception:\n\nTraceback (most recent call last):\n  File \"y.py\"\n"
        "trainfast.data.decode.CorruptImageError: cannot decode image '/d/a.jpg': image file is truncated\n")
    args = build_parser().parse_args(["train", "--on-bad-sample", "error"])
    message = error_message(wrapped, args)
    assert message.startswith("cannot decode image '/d/a.jpg': image file is truncated. Fix or remove the file, or "
                              "rerun with --on-bad-sample skip")
    assert "Traceback" not in message
    skipping = build_parser().parse_args(["train", "--on-bad-sample", "skip"])
    assert "--on-bad-sample skip tolerates up to 1%" in error_message(CorruptImageError("too many"), skipping)
    bench = build_parser().parse_args(["bench"])
    assert error_message(CorruptImageError("cannot decode image 'x'"), bench) == ("cannot decode image 'x'. Fix or "
                                                                                   "remove the file")
