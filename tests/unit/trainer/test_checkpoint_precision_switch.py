"""Resuming under another precision: a checkpoint saved without loss scaling (bf16, fp32) resumed where fp16 is
chosen keeps a fresh scaler; an fp16 checkpoint resumed without scaling ignores the saved scale."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from helpers import train_blobs as train
from trainfast.precision.policy import ScalerConfig


@pytest.mark.parametrize("saved_under", ["bf16-mixed", "32-true"])
def test_a_checkpoint_without_scaler_state_resumed_under_fp16_keeps_a_fresh_scaler(
        tmp_path: Path, trainfast_log: pytest.LogCaptureFixture, saved_under: str) -> None:
    train(tmp_path, epochs=1, precision=saved_under)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["scaler"]["scaler"] == {}  # a disabled GradScaler's
    trainfast_log.clear()
    resumed = train(tmp_path, epochs=2, precision="16-mixed", scaler=ScalerConfig(init_scale=1024.0))
    assert resumed.scaler.enabled and resumed.epoch == 2 and resumed.step == 8
    notes = [r.getMessage() for r in trainfast_log.records if "loss scaler" in r.getMessage()]
    assert len(notes) == 1 and str(tmp_path / "last.pt") in notes[0] and "fresh" in notes[0], notes
    assert trainfast_log.records[[r.getMessage() for r in trainfast_log.records].index(notes[0])].levelno == \
        logging.INFO
    saved = torch.load(tmp_path / "last.pt", weights_only=True)["scaler"]["scaler"]
    assert saved["scale"] > 0  # the fp16 run's own scaler state is saved from now on


@pytest.mark.parametrize("resumed_under", ["bf16-mixed", "32-true"])
def test_an_fp16_checkpoint_resumed_without_loss_scaling_ignores_the_saved_scale(
        tmp_path: Path, resumed_under: str) -> None:
    train(tmp_path, epochs=1, precision="16-mixed", scaler=ScalerConfig(init_scale=1024.0))
    assert torch.load(tmp_path / "last.pt", weights_only=True)["scaler"]["scaler"]["scale"] > 0
    resumed = train(tmp_path, epochs=2, precision=resumed_under)
    assert not resumed.scaler.enabled and resumed.epoch == 2 and resumed.step == 8
    assert resumed.scaler.loss_scale == 1.0


def test_an_fp16_run_resumed_under_auto_keeps_fp16_and_its_loss_scaler(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed "auto" run trains with the precision its checkpoint was saved in (a choice that changed would change
    its results): an fp16 run resumed where "auto" would now pick bf16 (a GPU without bf16 before, one with it now;
    here a CPU said to have native bf16) trains fp16 again, and so needs its loss scaler, with the saved scale."""
    from trainfast.precision import cpufeatures

    train(tmp_path, epochs=1, precision="16-mixed", scaler=ScalerConfig(init_scale=1024.0))
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["practices"]["precision"] == "16-mixed"
    monkeypatch.setattr(cpufeatures, "cpu_bf16", lambda: "AVX512-BF16")
    resumed = train(tmp_path, epochs=2, precision="auto")
    assert resumed.precision.name == "16-mixed" and resumed.epoch == 2
    assert resumed.scaler.enabled  # fp16 without loss scaling would lose small gradients to underflow
    assert resumed.scaler.loss_scale == saved["scaler"]["scaler"]["scale"]  # 4 steps at 1024: no growth, no skip
