"""Room for checkpoints, checked before training: keep_checkpoints rotated files + best.pt (+ the copy that replaces
it), each estimated from the model and optimizer state; a warning with the estimate, the free space and the fixes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import Usage
from trainfast import TrainConfig, Trainer, make_loader
from trainfast.atomic import free_bytes
from trainfast.envcheck.checks import checkpoint_space_check, format_bytes
from trainfast.trainer.checkpoint import estimate_checkpoint_bytes

MIB = 2**20


@pytest.mark.parametrize(("free", "held", "status"), [
    (None, 0, "info"),
    (100 * MIB, 0, "ok"),  # 4 files of 10 MiB fit
    (40 * MIB, 0, "ok"),
    (39 * MIB, 0, "warn"),
    (25 * MIB, 20 * MIB, "ok"),  # a resumed run: the checkpoints there are replaced, their bytes count as room
    (9 * MIB, 0, "fail"),  # not even one
    (5 * MIB, 5 * MIB, "warn"),
])
def test_checkpoint_space_verdicts(free: int | None, held: int, status: str) -> None:
    check = checkpoint_space_check("/ck", free, 10 * MIB, keep=2, held_bytes=held)
    assert check.name == "checkpoint_space" and check.status == status
    if status in ("warn", "fail"):
        assert f"checkpoint folder '/ck' has {format_bytes(free)} free" in check.detail
        assert "each checkpoint takes about 10.0 MiB (model and optimizer state), and up to 4 are on disk at once " \
               "(keep_checkpoints=2, best.pt and the copy that replaces it): 40.0 MiB" in check.detail
        assert check.fix == ("free space in '/ck', lower keep_checkpoints (now 2), or use another checkpoint_dir "
                             "(--checkpoint-dir) on a volume with room")
    if held and status != "ok":
        assert f"+ {format_bytes(held)} in the checkpoints already there" in check.detail


def test_free_bytes_are_read_from_the_nearest_existing_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Path] = []

    def usage(path: Path) -> Usage:
        asked.append(Path(path))
        return Usage(100, 60, 40)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    assert free_bytes(tmp_path / "runs" / "a") == 40  # not made yet: its volume is the parent's
    assert asked == [tmp_path]


@pytest.mark.parametrize(("make", "copies"), [
    (lambda params: torch.optim.AdamW(params), 2),  # exp_avg and exp_avg_sq
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1),
    (lambda params: torch.optim.SGD(params, lr=0.1), 0),
])
def test_the_estimate_before_the_first_step_matches_the_checkpoint_after_it(tmp_path: Path, make: object,
                                                                            copies: int) -> None:
    model = nn.Linear(256, 256)
    optimizer = make(model.parameters())  # type: ignore[operator]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    estimate = estimate_checkpoint_bytes(model, optimizer)
    assert estimate == pytest.approx((1 + copies) * weights, abs=32 * 1024)  # + RNG states, config
    config = TrainConfig(epochs=1, checkpoint_dir=str(tmp_path), progress=False, device="cpu")
    x, y = torch.randn(32, 256), torch.randint(0, 256, (32,))
    Trainer(model, optimizer, config=config).fit(make_loader((x, y), 16))
    assert (tmp_path / "last.pt").stat().st_size == pytest.approx(estimate, rel=0.02)
    assert estimate_checkpoint_bytes(model, optimizer) == pytest.approx(estimate, rel=0.01)  # from the state now


def test_training_warns_before_the_first_step_when_the_checkpoints_will_not_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainfast_log: pytest.LogCaptureFixture) -> None:
    free = 2 * MIB  # room for two checkpoints of 791 KiB, not for the four training keeps at once
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - free, free))
    steps: list[int] = []

    class Steps:
        def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
            steps.append(len(trainfast_log.records))

    config = TrainConfig(epochs=1, checkpoint_dir=str(tmp_path / "ck"), progress=False, device="cpu", log_every=1)
    x, y = torch.randn(32, 256), torch.randint(0, 256, (32,))
    Trainer(nn.Linear(256, 256), config=config, callbacks=[Steps()]).fit(make_loader((x, y), 16))
    warnings = [(i, r.getMessage()) for i, r in enumerate(trainfast_log.records) if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    index, message = warnings[0]
    assert index < steps[0]  # said before training starts
    assert message.startswith(f"pre-flight checkpoint_space: checkpoint folder {str(tmp_path / 'ck')!r} has 2.0 MiB "
                              "free, less than training needs: each checkpoint takes about 791.0 KiB (model and "
                              "optimizer state), and up to 4 are on disk at once (keep_checkpoints=2, best.pt and "
                              "the copy that replaces it): 3.1 MiB")
    assert message.endswith("(fix: free space in " + repr(str(tmp_path / "ck")) + ", lower keep_checkpoints (now 2), "
                            "or use another checkpoint_dir (--checkpoint-dir) on a volume with room)")


def test_no_warning_with_room_or_without_a_checkpoint_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          trainfast_log: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 0, 10**12))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for ckpt in (str(tmp_path), None):
        config = TrainConfig(epochs=1, checkpoint_dir=ckpt, progress=False, device="cpu")
        Trainer(nn.Linear(8, 4), config=config).fit(make_loader((x, y), 16))
    assert [r.getMessage() for r in trainfast_log.records if r.levelno >= logging.WARNING] == []
