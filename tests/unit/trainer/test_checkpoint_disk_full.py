"""A checkpoint write that fails (a full disk: ENOSPC, or the RuntimeError torch's zip writer raises there) never
loses the previous checkpoint: a failed best.pt copy only warns and training goes on; a failed last.pt stops training
with a `CheckpointWriteError` that names the folder, the bytes needed and free, and the checkpoint to resume from."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
import torch
from torch import nn

from helpers import Usage, blobs
from helpers import train_blobs as train
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.atomic import TEMP_PREFIX
from trainfast.envcheck.checks import format_bytes
from trainfast.trainer import CheckpointError, CheckpointWriteError, load_checkpoint

FREE = 12_345  # what the fake volume reports free


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def small_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - FREE, FREE))


def test_a_full_disk_on_the_best_copy_warns_once_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_volume: None,
        trainfast_log: pytest.LogCaptureFixture) -> None:
    def full(source: BinaryIO, target: BinaryIO, length: int = 0) -> None:
        target.write(source.read(1000))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", full)  # atomic_copy's writer: only the best.pt copy uses it
    trainer = train(tmp_path, epochs=2, val=True)
    assert trainer.epoch == 2 and trainer.best_metric is not None
    last = tmp_path / "last.pt"
    assert load_checkpoint(last)["epoch"] == 2
    assert names(tmp_path) == ["last.1.pt", "last.pt"]  # no best.pt, no temporary file left
    warnings = [r.getMessage() for r in trainfast_log.records
                if r.levelno == logging.WARNING and not r.getMessage().startswith("pre-flight")]
    assert 1 <= len(warnings) <= 2  # one per improved epoch: the first always improves
    for message in warnings:
        assert message.startswith(f"could not write checkpoint {str(tmp_path / 'best.pt')!r}: No space left on "
                                  f"device (errno {errno.ENOSPC}); {str(tmp_path)!r} has {format_bytes(FREE)} free, "
                                  "the file needs ")
        assert f"Training goes on: best.pt was not written, and {str(last)!r} (the resume point) is intact" in message
        assert "lower keep_checkpoints, or use another checkpoint_dir" in message


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_a_full_disk_on_last_pt_stops_with_a_write_error_and_keeps_the_previous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_volume: None, full_volume: Any, keep: int) -> None:
    train(tmp_path, epochs=2, keep_checkpoints=keep)
    before = {name: (tmp_path / name).read_bytes() for name in names(tmp_path)}
    full_volume.torch_save_from(1)
    with pytest.raises(CheckpointWriteError) as info:
        train(tmp_path, epochs=3, keep_checkpoints=keep)
    assert isinstance(info.value, CheckpointError)  # callers that catch CheckpointError still do
    last = tmp_path / "last.pt"
    message = str(info.value)
    assert message.startswith(f"could not write checkpoint {str(last)!r}: No space left on device (errno "
                              f"{errno.ENOSPC}); {str(tmp_path)!r} has {format_bytes(FREE)} free, the file needs ")
    assert f"Training stopped; the last intact checkpoint is {str(last)!r}: resume from it" in message
    # last.pt is the previous one, byte for byte, and so are the older ones, but for the oldest kept slot that the
    # rotation gave up to make room for the new file; no temporary file is left
    dropped = f"last.{keep - 1}.pt"
    assert {name: (tmp_path / name).read_bytes() for name in names(tmp_path)} == {
        name: data for name, data in before.items() if name != dropped}
    assert not any(name.startswith(TEMP_PREFIX) for name in names(tmp_path))
    monkeypatch.undo()
    assert train(tmp_path, epochs=3, keep_checkpoints=keep).epoch == 3  # there is room again: resume goes on


def test_a_first_save_that_fails_says_there_is_nothing_to_resume_from(
        tmp_path: Path, small_volume: None, full_volume: Any) -> None:
    full_volume.torch_save_from(1)
    with pytest.raises(CheckpointWriteError, match="no checkpoint was written yet, so there is none to resume from"):
        train(tmp_path, epochs=1)
    assert names(tmp_path) == []


def test_the_bytes_needed_are_the_size_of_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         small_volume: None, full_volume: Any) -> None:
    """What the message says is needed is what a successful write takes, give or take the metadata."""
    x, y = torch.randn(32, 256), torch.randint(0, 256, (32,))
    config = TrainConfig(epochs=1, checkpoint_dir=str(tmp_path), progress=False, device="cpu")
    full_volume.torch_save_from(1)
    with pytest.raises(CheckpointWriteError) as info:
        Trainer(nn.Linear(256, 256), config=config).fit(make_loader((x, y), 16))
    monkeypatch.undo()
    Trainer(nn.Linear(256, 256), config=config).fit(make_loader((x, y), 16))
    written = (tmp_path / "last.pt").stat().st_size  # 257 KiB of weights + 514 KiB of AdamW moments + metadata
    found = re.search(r"the file needs ([\d.]+) KiB", str(info.value))
    assert found is not None, str(info.value)
    assert float(found.group(1)) * 1024 == pytest.approx(written, rel=0.02)


def test_a_write_refused_for_another_reason_names_that_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           small_volume: None) -> None:
    train(tmp_path, epochs=1)

    def refused(obj: object, f: BinaryIO, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(torch, "save", refused)
    with pytest.raises(CheckpointWriteError) as info:
        train(tmp_path, epochs=2)
    message = str(info.value)
    assert f"Permission denied (errno {errno.EACCES})" in message
    assert message.endswith(f"Fix: make {str(tmp_path)!r} writable, or use another checkpoint_dir (--checkpoint-dir)")
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 1


def test_torch_s_zip_writer_failing_on_a_full_disk_stops_cleanly_and_resume_goes_on(
        tmp_path: Path, small_volume: None, full_volume: Any, zip_writer_full: str) -> None:
    """On a full volume torch.save raises RuntimeError, not OSError: still a `CheckpointWriteError` with the one
    message, the rotation undone (last.pt is epoch 1's, whole), and a resume that goes on."""
    train(tmp_path, epochs=1)
    before = (tmp_path / "last.pt").read_bytes()
    full_volume.torch_save_from(1, lambda: RuntimeError(zip_writer_full))
    with pytest.raises(CheckpointWriteError) as info:
        train(tmp_path, epochs=2)
    last = tmp_path / "last.pt"
    message = str(info.value)
    assert message.startswith(f"could not write checkpoint {str(last)!r}: torch's zip writer failed "
                              f"({zip_writer_full}); {str(tmp_path)!r} has {format_bytes(FREE)} free, the file "
                              "needs "), message
    assert f"Training stopped; the last intact checkpoint is {str(last)!r}: resume from it" in message
    # torch gave no errno, but 12 KiB are free for a 19 KiB checkpoint: no room, and the fix says so
    assert message.endswith(f"Fix: free space in {str(tmp_path)!r}, lower keep_checkpoints, or use another "
                            "checkpoint_dir (--checkpoint-dir)"), message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert names(tmp_path) == ["last.pt"] and last.read_bytes() == before  # no last.1.pt left in its place
    assert load_checkpoint(last)["epoch"] == 1
    full_volume.monkeypatch.undo()
    assert train(tmp_path, epochs=2).epoch == 2
    assert load_checkpoint(last)["epoch"] == 2


def test_an_error_that_is_no_failed_write_undoes_the_rotation_and_keeps_its_own_type(
        tmp_path: Path, full_volume: Any) -> None:
    train(tmp_path, epochs=1)
    full_volume.torch_save_from(1, lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        train(tmp_path, epochs=2)
    assert not isinstance(info.value, CheckpointError)  # a bug, not a full disk: its own traceback
    assert names(tmp_path) == ["last.pt"] and load_checkpoint(tmp_path / "last.pt")["epoch"] == 1


def test_a_real_full_volume_warns_for_best_pt_then_stops_and_resumes_once_there_is_room(
        mount_tmpfs: Callable[[str], Any], trainfast_log: pytest.LogCaptureFixture) -> None:
    """A 2 MiB tmpfs and 1.1 MiB checkpoints: last.pt fits, best.pt beside it does not (a warning), nor the next
    last.pt beside the previous (the stop). torch's own zip writer fails here, with its RuntimeError."""
    volume = mount_tmpfs("2m")
    ckpt = volume.path / "ck"

    def fit(epochs: int) -> Trainer:
        x, y = blobs()
        x = x.repeat(1, 40)  # 320 features: a 320x320 layer, 0.4 MiB of weights + 0.8 MiB of AdamW moments
        torch.manual_seed(0)
        config = TrainConfig(epochs=epochs, checkpoint_dir=str(ckpt), progress=False, device="cpu")
        trainer = Trainer(nn.Linear(320, 320), config=config)
        trainer.fit(make_loader((x, y), 16), make_loader((x, y), 64, shuffle=False), resume=True)
        return trainer

    with pytest.raises(CheckpointWriteError) as info:
        fit(epochs=3)
    last = ckpt / "last.pt"
    message = str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError), repr(info.value.__cause__)  # torch's, not an OSError
    assert message.startswith(f"could not write checkpoint {str(last)!r}: No space left on device (errno "
                              f"{errno.ENOSPC}); {str(ckpt)!r} has "), message
    assert f"the last intact checkpoint is {str(last)!r}: resume from it" in message
    warned = [r.getMessage() for r in trainfast_log.records
              if r.getMessage().startswith(f"could not write checkpoint {str(ckpt / 'best.pt')!r}")]
    assert len(warned) == 1 and "Training goes on: best.pt was not written" in warned[0]
    assert names(ckpt) == ["last.pt"]  # the rotation undone, no temporary file left
    assert load_checkpoint(last)["epoch"] == 1
    volume.resize("16m")
    assert fit(epochs=3).epoch == 3
    assert load_checkpoint(last)["epoch"] == 3
