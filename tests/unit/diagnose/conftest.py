"""Fixtures shared by the doctor's unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from trainfast.diagnose.capture import timeline as timeline_module


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The timeline's clock, at 100.0 s until a test moves it (`clock[0] += seconds`)."""
    now = [100.0]
    monkeypatch.setattr(timeline_module.time, "perf_counter", lambda: now[0])
    yield now


@pytest.fixture
def server() -> Iterator[Any]:
    """A TCPStore on a free loopback port, the store the ranks' agreement goes through (this process is its server)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store
