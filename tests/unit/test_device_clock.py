"""DeviceClock: the timer of every measured step synchronises the device it times, at start and at read."""

from __future__ import annotations

import time

import pytest
import torch

from trainfast import device as device_module
from trainfast.device import DeviceClock


def test_the_clock_synchronises_its_device_when_it_starts_and_when_it_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[object] = []
    monkeypatch.setattr(device_module, "synchronize", synced.append)
    clock = DeviceClock(torch.device("cuda", 1))
    clock.start()
    assert synced == [torch.device("cuda", 1)]
    time.sleep(0.02)
    elapsed = clock.elapsed()
    assert synced == [torch.device("cuda", 1)] * 2
    assert 0.015 < elapsed < 1.0


def test_each_read_is_from_the_last_start() -> None:
    clock = DeviceClock("cpu")
    clock.start()
    time.sleep(0.03)
    first = clock.elapsed()
    clock.start()
    assert clock.elapsed() < first
