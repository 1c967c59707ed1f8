"""Faults around checkpoints: killed mid-write, corrupt or truncated files, malicious pickles, stale temps;
and non-finite losses under fp16 loss scaling."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import blobs
from helpers import train_blobs as train
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.atomic import TEMP_PREFIX
from trainfast.trainer import CheckpointError, NonFiniteLossError, load_checkpoint


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_killed_during_a_checkpoint_write_leaves_the_previous_one(tmp_path: Path) -> None:
    """SIGKILL while torch.save is writing: last.pt is still the previous, complete checkpoint; the orphaned
    temporary file is removed when training starts again."""
    train(tmp_path, epochs=1)
    before = (tmp_path / "last.pt").read_bytes()
    writer = textwrap.dedent(f"""
        import sys, time, torch
        from trainfast.atomic import atomic_write
        def slow(f):
            f.write(b"PK" + b"x" * 1_000_000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
        atomic_write({str(tmp_path / "last.pt")!r}, slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert (tmp_path / "last.pt").read_bytes() == before
    assert list(tmp_path.glob(f"{TEMP_PREFIX}*.tmp"))  # the orphan is there...
    resumed = train(tmp_path, epochs=2)
    assert not list(tmp_path.glob(f"{TEMP_PREFIX}*.tmp"))  # ...and gone once training starts again
    assert resumed.epoch == 2


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_last_checkpoint_falls_back_to_the_previous(tmp_path: Path, damage: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    train(tmp_path, epochs=2)  # last.pt (epoch 2) and last.1.pt (epoch 1)
    assert load_checkpoint(tmp_path / "last.1.pt")["epoch"] == 1
    data = bytearray((tmp_path / "last.pt").read_bytes())
    if damage == "flip":
        middle = len(data) // 2
        data[middle] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    (tmp_path / "last.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last\.pt"):
        load_checkpoint(tmp_path / "last.pt")
    logger = logging.getLogger("trainfast")
    logger.addHandler(caplog.handler)
    try:
        resumed = train(tmp_path, epochs=3)
    finally:
        logger.removeHandler(caplog.handler)
    assert "falling back to" in caplog.text and "last.1.pt" in caplog.text
    assert resumed.epoch == 3  # continued from epoch 1: one epoch of work redone, none lost for good


def test_every_kept_checkpoint_corrupt_is_a_clear_error(tmp_path: Path) -> None:
    train(tmp_path, epochs=2)
    for name in ("last.pt", "last.1.pt"):
        (tmp_path / name).write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        train(tmp_path, epochs=3)


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch " + str(Path(os.environ["PAYLOAD_MARK"])),))


def test_a_malicious_checkpoint_is_refused_unless_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = tmp_path / "pwned"
    monkeypatch.setenv("PAYLOAD_MARK", str(mark))
    torch.save({"model": {}, "evil": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"(?s)cannot be loaded safely.*trusted=True"):
        load_checkpoint(tmp_path / "evil.pt")
    with pytest.raises(CheckpointError):
        Trainer(nn.Linear(8, 4), config=TrainConfig(progress=False, device="cpu")).fit(
            make_loader(blobs(), 16), resume=tmp_path / "evil.pt")
    assert not mark.exists()  # nothing was executed
    load_checkpoint(tmp_path / "evil.pt", trusted=True)  # the explicit opt-in does unpickle it
    assert mark.exists()


def test_fp16_overflow_is_skipped_and_counted_but_a_persistent_one_stops(tmp_path: Path) -> None:
    x, y = blobs()
    calls = {"n": 0}

    def sometimes_inf(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        loss = F.cross_entropy(out, target)
        return loss * math.inf if calls["n"] in (3, 7) else loss  # two transient overflows

    config = TrainConfig(epochs=2, precision="16-mixed", progress=False, device="cpu", log_every=2)
    result = Trainer(nn.Linear(8, 4), loss_fn=sometimes_inf, config=config).fit(make_loader((x, y), 16))
    assert result.skipped_steps >= 2 and result.steps == 8

    def always_nan(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target) * math.nan

    config = TrainConfig(epochs=3, precision="16-mixed", progress=False, device="cpu", log_every=2,
                         checkpoint_dir=str(tmp_path))
    with pytest.raises(NonFiniteLossError, match="non-finite"):
        Trainer(nn.Linear(8, 4), loss_fn=always_nan, config=config).fit(make_loader((x, y), 16))
    assert not (tmp_path / "last.pt").exists()  # nothing saved from a non-finite run
