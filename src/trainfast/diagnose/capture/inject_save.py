"""The `async_checkpoint` fix that `apply_overrides` injects (capture/inject.py): `torch.save` to a path copies what
it saves to host memory, then writes it in a background thread while training goes on. Training waits for the copy
only (the write is what the fix takes off its path).

What keeps the script's own view of its files right:
- one write at a time: a second `torch.save` waits for the first write;
- `os.replace`, `os.rename`, `shutil.copyfile` and `torch.load` wait for the write first (a script that saves to a
  temporary name and renames it, or reads back what it wrote, sees the whole file);
- a save of something that cannot be copied (a whole `nn.Module` or optimizer, pickled with its code), to a file
  object, or from another thread, is written as the script asked: synchronously;
- on exit the last write is waited for; a write that failed raises there (and at the next save), never silently.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map


class BackgroundSaves:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path = ""
        self.writes = 0
        self._original_save = torch.save

    def install(self, stack: ExitStack) -> None:
        stack.callback(self.close)
        stack.enter_context(mock.patch.object(torch, "save", self.save))
        for owner, name in ((os, "replace"), (os, "rename"), (shutil, "copyfile"), (torch, "load")):
            stack.enter_context(mock.patch.object(owner, name, self._after_write(getattr(owner, name))))

    def _after_write(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def waits(*args: Any, **kwargs: Any) -> Any:
            self.wait()
            return function(*args, **kwargs)
        return waits

    def wait(self) -> None:
        """The write under way finished; its failure raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the checkpoint written in the background to {self._path!r} failed: "
                               f"{type(error).__name__}: {error}") from error

    def close(self) -> None:
        self.wait()
        if self.writes:
            self.events.append(f"{self.writes} torch.save call(s) written in the background after a copy to host "
                               "memory")

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        copyable = not any(isinstance(x, (nn.Module, torch.optim.Optimizer)) for x in tree_leaves(obj))
        if (not isinstance(f, (str, os.PathLike)) or not copyable
                or threading.current_thread() is not threading.main_thread()):
            self.wait()
            self._original_save(obj, f, *args, **kwargs)
            return
        self.wait()
        host = tree_map(lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, obj)
        self._path = os.fspath(f)
        self.writes += 1

        def write() -> None:
            try:
                self._original_save(host, f, *args, **kwargs)
            except BaseException as e:  # raised in the script's thread at the next save, rename or exit
                self._error = e
        self._thread = threading.Thread(target=write, name="trainfast-checkpoint-write", daemon=False)
        self._thread.start()
