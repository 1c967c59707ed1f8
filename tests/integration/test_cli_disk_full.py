"""`trainfast train` on a checkpoint folder whose volume fills up: never a traceback. No room for last.pt: one
message (folder, bytes needed and free, the checkpoint to resume from) and exit 1; no room for best.pt: a warning,
and training goes on to exit 0."""

from __future__ import annotations

import errno
import logging
import shutil
import sys
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch

from trainfast.cli import main


def small(tiny_images: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(tiny_images), "--image-size", "32", "--batch-size", "16", "--no-progress",
            "--workers", "0", "--limit-batches", "2", "--limit-val-batches", "1", *extra]


class Stderr(logging.StreamHandler[Any]):
    """Writes to the `sys.stderr` of the moment a record comes (pytest swaps it between a test's phases)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


@pytest.fixture
def stderr_log(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> pytest.CaptureFixture[str]:
    """trainfast's log lines on this test's stderr, as the `trainfast` command prints them in a process of its
    own (under pytest, the package's handler holds a capture file of pytest's)."""
    handler = Stderr()
    handler.setFormatter(logging.Formatter("trainfast: %(message)s"))
    logger = logging.getLogger("trainfast")
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)
    return capsys


def test_no_room_for_last_pt_exits_1_with_one_message_and_no_traceback(
        tiny_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        stderr_log: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ck"
    real_save, calls = torch.save, [0]

    def save(obj: object, f: BinaryIO, *args: Any, **kwargs: Any) -> None:  # the volume fills up during epoch 2
        calls[0] += 1
        if calls[0] == 1:
            real_save(obj, f, *args, **kwargs)
            return
        f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)
    assert main(small(tiny_images, "--epochs", "2", "--checkpoint-dir", str(ckpt))) == 1
    err = stderr_log.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "could not write checkpoint" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"trainfast train: error: could not write checkpoint {str(ckpt / 'last.pt')!r}: No "
                               f"space left on device (errno {errno.ENOSPC}); {str(ckpt)!r} has ")
    assert " free, the file needs " in lines[0]
    assert f"the last intact checkpoint is {str(ckpt / 'last.pt')!r}: resume from it" in lines[0]
    assert "usage:" not in err  # not reported as bad input
    assert torch.load(ckpt / "last.pt", weights_only=True)["epoch"] == 1  # epoch 1's checkpoint, intact
    assert sorted(p.name for p in ckpt.iterdir()) == ["best.pt", "last.pt"]


def test_no_room_for_best_pt_warns_and_finishes(tiny_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                stderr_log: pytest.CaptureFixture[str]) -> None:
    def full(source: BinaryIO, target: BinaryIO, length: int = 0) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", full)
    ckpt = tmp_path / "ck"
    assert main(small(tiny_images, "--epochs", "1", "--checkpoint-dir", str(ckpt))) == 0
    captured = stderr_log.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.count(f"could not write checkpoint {str(ckpt / 'best.pt')!r}") == 1
    assert "Training goes on: best.pt was not written" in captured.err
    assert f"checkpoints: {ckpt / 'last.pt'}\n" in captured.out
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.pt"]


def test_out_of_memory_in_training_exits_1_with_the_advice_and_no_traceback(
        tiny_images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        stderr_log: pytest.CaptureFixture[str]) -> None:
    from trainfast.cli import train as train_cli

    build = train_cli.build_model

    def failing_model(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = build(*args, **kwargs)

        def forward(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")
        model.forward = forward  # type: ignore[method-assign]
        return model

    monkeypatch.setattr(train_cli, "build_model", failing_model)
    assert main(small(tiny_images, "--checkpoint-dir", str(tmp_path / "ck"))) == 1
    err = stderr_log.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "out of memory on cpu at epoch 1, step 0 (batch size 16)" in line]
    assert "find_batch_size" in err and "no checkpoint was written yet" in err
