"""Fixtures of the Trainer's tests."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest


class StopAt:
    """Sends this process SIGTERM at a given optimizer step, like a scheduler preempting the job (the Trainer reads
    metrics there: use log_every=1)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_log(self, trainer: Any, metrics: dict[str, Any]) -> None:
        if metrics["step"] == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def stop_at() -> Callable[[int], StopAt]:
    """`stop_at(step)`: a callback that SIGTERMs this process at that optimizer step."""
    return StopAt
