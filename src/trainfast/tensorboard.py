"""TensorBoard scalars: `ScalarWriter(folder)` writes `{tag: value}` at a step into an event file that TensorBoard
reads (`tensorboard --logdir folder`). The tags are the caller's ("train/loss", "val/accuracy", ...).

The `SummaryWriter` (`torch.utils.tensorboard`) is opened on the first write, so a writer that writes nothing leaves
no file; `close()` flushes and closes it. The `tensorboard` package is an extra: `require_tensorboard()` (called by
`ScalarWriter` itself) raises one `TensorBoardUnavailableError` naming the fix when it is missing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

INSTALL_HINT = "pip install 'trainfast[tensorboard]'"


class TensorBoardUnavailableError(ImportError):
    """The `tensorboard` package is not installed; the message names the fix."""


def require_tensorboard() -> None:
    """Raise `TensorBoardUnavailableError` (with the install command) unless the tensorboard package is installed."""
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except ValueError:  # a module whose __spec__ is None: present, but not found the usual way
        found = True
    if not found:
        raise TensorBoardUnavailableError(
            f"TensorBoard logging needs the tensorboard package, which is not installed: {INSTALL_HINT}")


class ScalarWriter:
    """Scalars for TensorBoard in `log_dir` (created on the first write). A context manager: closed on exit."""

    def __init__(self, log_dir: str | Path) -> None:
        require_tensorboard()
        self.log_dir = Path(log_dir)
        self._writer: Any = None  # torch.utils.tensorboard.SummaryWriter, once opened

    def _open(self) -> Any:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's own check: too old a tensorboard, or a broken install
                raise TensorBoardUnavailableError(f"TensorBoard logging could not start ({e}): {INSTALL_HINT}") from e
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def scalars(self, step: int, values: Mapping[str, float | None], wall_time: float | None = None) -> None:
        """Write each `tag: value` at `step` (`wall_time`: seconds since the epoch, now by default). A value of None
        is left out (a figure this point does not have); NaN and infinities are written as they are."""
        given = {tag: float(value) for tag, value in values.items() if value is not None}
        if not given:
            return
        writer = self._open()
        for tag, value in given.items():
            writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def flush(self) -> None:
        """Put what was written so far into the event file (it is otherwise flushed every 2 minutes and at close)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; a later write opens a new one."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def __enter__(self) -> ScalarWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


__all__ = ["INSTALL_HINT", "ScalarWriter", "TensorBoardUnavailableError", "require_tensorboard"]
