"""A checkpoint write that fails (a full disk: ENOSPC) never loses the previous checkpoint: a failed best.pt copy
only warns and training goes on; a failed last.pt stops training with a `CheckpointWriteError` that names the
folder, the bytes needed and free, and the checkpoint to resume from."""

from __future__ import annotations

import errno
import logging
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import pytest
import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.atomic import TEMP_PREFIX
from trainfast.envcheck.checks import format_bytes
from trainfast.trainer import CheckpointError, CheckpointWriteError, load_checkpoint

FREE = 12_345  # what the fake volume reports free


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def blobs(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.randn(4, 8, generator=g)[y] * 3 + torch.randn(n, 8, generator=g), y


def train(ckpt: Path, epochs: int, *, val: bool = False, **overrides: Any) -> Trainer:
    x, y = blobs()
    torch.manual_seed(0)
    config = TrainConfig(epochs=epochs, checkpoint_dir=str(ckpt), progress=False, device="cpu", **overrides)
    trainer = Trainer(nn.Linear(8, 4), config=config)
    trainer.fit(make_loader((x, y), 16), make_loader((x, y), 64, shuffle=False) if val else None, resume=True)
    return trainer


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def small_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - FREE, FREE))


def fail_torch_save_from(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """`torch.save` fills the disk from its `call`-th call on: half a file is written, then ENOSPC."""
    real_save, calls = torch.save, [0]

    def save(obj: object, f: BinaryIO, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] < call:
            real_save(obj, f, *args, **kwargs)
            return
        f.write(b"PK\x03\x04" + b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)


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
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_volume: None, keep: int) -> None:
    train(tmp_path, epochs=2, keep_checkpoints=keep)
    before = {name: (tmp_path / name).read_bytes() for name in names(tmp_path)}
    fail_torch_save_from(monkeypatch, call=1)
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
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_volume: None) -> None:
    fail_torch_save_from(monkeypatch, call=1)
    with pytest.raises(CheckpointWriteError, match="no checkpoint was written yet, so there is none to resume from"):
        train(tmp_path, epochs=1)
    assert names(tmp_path) == []


def test_the_bytes_needed_are_the_size_of_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         small_volume: None) -> None:
    """What the message says is needed is what a successful write takes, give or take the metadata."""
    x, y = torch.randn(32, 256), torch.randint(0, 256, (32,))
    config = TrainConfig(epochs=1, checkpoint_dir=str(tmp_path), progress=False, device="cpu")
    fail_torch_save_from(monkeypatch, call=1)
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
