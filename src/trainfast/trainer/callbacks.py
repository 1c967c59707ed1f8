"""Callbacks are plain objects with any of these optional methods (no base class to subclass):

- `on_fit_start(trainer)`
- `on_epoch_start(trainer, epoch)`
- `on_log(trainer, metrics)`            every `log_every` optimizer steps; metrics already on the host
- `on_validation_end(trainer, metrics)`
- `on_checkpoint(trainer, path)`        after a checkpoint is safely on disk (an epoch's checkpoint is written in
                                        the background: its event comes when the next save or the end of fit has
                                        waited for the write)
- `on_epoch_end(trainer, epoch, metrics)`
- `on_fit_end(trainer, result)`

There is deliberately no per-batch event: a callback per step is where trainers lose their speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EVENTS = ("on_fit_start", "on_epoch_start", "on_log", "on_validation_end", "on_checkpoint", "on_epoch_end",
          "on_fit_end")


def check_callbacks(callbacks: Sequence[object]) -> None:
    """Reject objects with no known event method (a typo like `on_epoch_ends` would never fire)."""
    for cb in callbacks:
        methods = [m for m in dir(cb) if m.startswith("on_") and callable(getattr(cb, m))]
        unknown = [m for m in methods if m not in EVENTS]
        if unknown or not methods:
            what = "unknown methods " + ", ".join(unknown) if unknown else "no on_* method"
            raise TypeError(f"callback {cb!r} has {what}; "
                            f"valid events: {', '.join(EVENTS)}")


def emit(callbacks: Sequence[object], event: str, *args: Any) -> None:
    for cb in callbacks:
        method = getattr(cb, event, None)
        if method is not None:
            method(*args)
