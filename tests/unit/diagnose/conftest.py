"""Fixtures shared by the doctor's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainfast.diagnose import timeline as timeline_module


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The timeline's clock, at 100.0 s until a test moves it (`clock[0] += seconds`)."""
    now = [100.0]
    monkeypatch.setattr(timeline_module.time, "perf_counter", lambda: now[0])
    yield now
