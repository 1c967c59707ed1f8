"""Precision facts read from the *target* device, and a loss scaler resumed from a run that had none."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainfast.precision.policy import DeviceCaps, LossScaler, ScalerConfig, device_caps, resolve_precision

CAPABILITIES = {0: (7, 5), 1: (8, 0), 2: (9, 0)}  # a host with a Turing GPU beside newer ones


@pytest.fixture
def mixed_host(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Three GPUs of different capability; returns a settable current device (index 0 of the list)."""
    current = [0]

    def index_of(device: Any) -> int:
        if device is None:
            return current[0]
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return current[0] if device.index is None else device.index

    def is_bf16_supported(including_emulation: bool = True) -> bool:  # torch's: asks the current device
        return CAPABILITIES[current[0]] >= (8, 0) or including_emulation

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: CAPABILITIES[index_of(device)])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    return current


@pytest.mark.parametrize(("current", "target", "bf16"), [(0, 1, True), (0, 2, True), (1, 0, False), (2, 0, False),
                                                         (1, 1, True), (0, 0, False)])
def test_bf16_is_read_from_the_target_device(mixed_host: list[int], current: int, target: int, bf16: bool) -> None:
    mixed_host[0] = current
    caps = device_caps(torch.device("cuda", target))
    major, minor = CAPABILITIES[target]
    assert caps == DeviceCaps("cuda", (major, minor), bf16, f"compute capability {major}.{minor}" if bf16 else None)
    assert resolve_precision("auto", caps).name == ("bf16-mixed" if bf16 else "16-mixed")


def test_cuda_without_an_index_is_the_current_device(mixed_host: list[int]) -> None:
    mixed_host[0] = 1
    assert device_caps(torch.device("cuda")).bf16 is True
    mixed_host[0] = 0
    assert device_caps(torch.device("cuda")).bf16 is False


def test_a_bf16_checkpoint_resumed_with_fp16_keeps_the_fresh_scale() -> None:
    saved = LossScaler(torch.device("cpu"), enabled=False).state_dict()  # what a bf16 run checkpoints
    fresh = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=128.0))
    assert fresh.load_state_dict(saved) is False
    assert (fresh.loss_scale, fresh.skipped_steps) == (128.0, 0)


def test_an_fp16_checkpoint_resumed_with_bf16_changes_nothing() -> None:
    fp16 = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=32.0))
    fp16._skipped += 3
    disabled = LossScaler(torch.device("cpu"), enabled=False)
    assert disabled.load_state_dict(fp16.state_dict()) is False
    assert (disabled.loss_scale, disabled.skipped_steps) == (1.0, 0)


def test_a_saved_scale_is_restored_and_reported() -> None:
    saved = LossScaler(torch.device("cpu"), enabled=True, config=ScalerConfig(init_scale=32.0))
    saved._skipped += 2
    fresh = LossScaler(torch.device("cpu"), enabled=True)
    assert fresh.load_state_dict(saved.state_dict()) is True
    assert (fresh.loss_scale, fresh.skipped_steps) == (32.0, 2)
