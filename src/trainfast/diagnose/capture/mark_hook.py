"""The marks' hook: what a step did besides training, for naming a period of slow steps (periodic.py) by what
happened in them: a checkpoint save (`torch.save`) and a print or log (`print`, `logging`'s handlers), on the main
thread. A flag on the step in progress per call (~0.2 us): these calls are rare in a training loop. Evaluation forwards
and epoch starts are marked by the model's and the loaders' hooks."""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainfast.diagnose.records.steps import LOG, SAVE

if TYPE_CHECKING:
    from trainfast.diagnose.capture.observations import Patch, Watching


class MarkHook:
    def __init__(self, inst: Watching) -> None:
        self.inst = inst

    def install(self, patch: Patch) -> None:
        main = threading.main_thread().ident
        timeline, inst = self.inst.timeline, self.inst

        def marking(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                if not inst.paused and threading.get_ident() == main:
                    timeline.mark(kind)
                return original(*args, **kwargs)
            return call

        patch(torch, "save", marking(torch.save, SAVE))
        patch(builtins, "print", marking(builtins.print, LOG))
        patch(logging.Logger, "callHandlers", marking(logging.Logger.callHandlers, LOG))

    def uninstall(self) -> None:
        pass
