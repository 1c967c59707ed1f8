"""Out of memory inside `fit`: one error that says where, what the allocator held, what to change, and which
checkpoint is intact."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from trainfast.oom import advice, first_line, is_oom, memory_at_oom


class TrainingOutOfMemoryError(torch.OutOfMemoryError):
    """Memory ran out inside `fit`: where, what the allocator held, what to change. No checkpoint was written
    after it (the last one is intact); the original error is its `__cause__`."""


@contextmanager
def explained_oom(device: torch.device, where: Callable[[], str], checkpoint_dir: str | None,
                  settle: Callable[[], None] = lambda: None) -> Iterator[None]:
    """An out-of-memory error in the block becomes a `TrainingOutOfMemoryError` (`where()`: the position, read as it
    failed); any other error passes as it is. `settle()` waits for a checkpoint write still in flight, so that the
    message names the checkpoint it leaves."""
    try:
        yield
    except Exception as e:
        if not is_oom(e):
            raise
        memory = memory_at_oom(device)
        settle()
        ckpt = Path(checkpoint_dir) / "last.pt" if checkpoint_dir else None
        kept = (f"{str(ckpt)!r} is untouched: resume from it (resume=True / --resume)" if ckpt and ckpt.is_file()
                else "no checkpoint was written yet")
        raise TrainingOutOfMemoryError(f"out of memory on {device} at {where()}: {first_line(e)}. "
                                       f"{advice(e, memory)}. {kept}") from e
