"""`Ledger`: what a whole run spends outside its training steps, recorded as it happens (`doctor --whole-run`).

The steps themselves come from the timeline (each closed step's span and its data wait, copies and input gap,
passed on by the instrumentation). Around them the ledger records intervals on the `perf_counter` clock:
- evaluation: forwards of a model with gradients off (`no_grad`, `inference_mode`) while it is in eval mode, and
  batches fetched with gradients off, the iterator's start-up included. Consecutive ones with no training step
  closed between them are one pass, from its first event to the end of its last forward; a pass's own data wait
  is its fetches' wait. A no-grad forward of a model in training mode is a collection phase (an RL rollout),
  part of training, unless it falls inside a pass a no-grad fetch opened;
- checkpoint: each `torch.save`, `safetensors.torch.save_file`/`save_model` and `torch.distributed.checkpoint`
  `save`/`async_save` call on the main thread: its seconds and bytes. A write on another thread (a background
  checkpoint) blocks no step: it is listed, not carved out of the run;
- epoch start: from a training loader's `iter()` to its first batch (worker start-up);
- sleeping (`time.sleep`) and printing/logging (`print`, `logging`'s handlers) on the main thread;
- the doctor's own work inside the run (its scans for the model, the timed candidate fixes): not the script's.
Each hook is a `perf_counter` pair on calls that are rare in a training loop (a print per step costs ~0.5 us more).
wholerun.py turns the records into phases that add up to the wall time.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from types import ModuleType
from typing import Any

import torch

from trainfast.diagnose.capture.sites import site_of
from trainfast.diagnose.records.capture import LedgerRecord, Site
from trainfast.diagnose.records.ledger import CHECKPOINT, DOCTOR, LOGGING, SLEEP, EvalPass, Write

# Checkpoint writes listed one by one in the report; beyond this they are only summed
MAX_WRITES = 1000


@dataclass
class Ledger:
    """The whole run's records (module doc). `steps_closed()` reads the timeline's count of closed steps: an
    evaluation pass ends where a training step closes."""

    process_start: float  # perf_counter time of the process start
    steps_closed: Callable[[], int] = lambda: 0
    intervals: list[tuple[str, float, float]] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    write_totals: dict[str, float] = field(default_factory=lambda: {"count": 0, "seconds": 0.0, "bytes": 0})
    passes: list[EvalPass] = field(default_factory=list)
    epoch_starts: list[tuple[float, float, float]] = field(default_factory=list)  # (iter(), first batch, its wait)
    # each closed step: start, end, data wait, copies, input gap (start to first input), samples
    step_start: array[float] = field(default_factory=lambda: array("d"))
    step_end: array[float] = field(default_factory=lambda: array("d"))
    step_wait: array[float] = field(default_factory=lambda: array("d"))
    step_transfer: array[float] = field(default_factory=lambda: array("d"))
    step_gap: array[float] = field(default_factory=lambda: array("d"))
    step_samples: array[int] = field(default_factory=lambda: array("q"))
    first_input: float | None = None
    loader_fed: bool = False
    doctor_parts: dict[str, float] = field(default_factory=dict)  # the doctor's own seconds, by what it did
    eval_call: tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]] | None = None  # a pass's first forward
    save_site: Site | None = None  # where the script wrote its first checkpoint (capture/sites.py)
    last_write: Write | None = None
    # attempts.py's record of the run on torchrun's store: `on_beat(now)` at the first step closed from `beat_due`
    on_beat: Callable[[float], None] | None = None
    beat_due: float = float("inf")
    _finders: list[_OnImport] = field(default_factory=list)
    _busy: bool = False  # inside a hooked call: a save's own prints, a print's logging, are that call's

    def record(self) -> LedgerRecord:
        """The ledger frozen, as the accounting reads it (evidence/wholerun.py)."""
        return LedgerRecord(
            process_start=self.process_start, intervals=tuple(self.intervals), writes=tuple(self.writes),
            write_totals=dict(self.write_totals), passes=tuple(self.passes), epoch_starts=tuple(self.epoch_starts),
            step_start=tuple(self.step_start), step_end=tuple(self.step_end), step_wait=tuple(self.step_wait),
            step_transfer=tuple(self.step_transfer), step_gap=tuple(self.step_gap),
            step_samples=tuple(self.step_samples), first_input=self.first_input, loader_fed=self.loader_fed,
            doctor_parts=dict(self.doctor_parts))

    # ---- the steps (instrumentation.py passes each closed one)
    def step(self, start: float, end: float, wait: float, transfer: float, first_input: float | None,
             samples: int, opening: bool) -> None:
        if opening or self.first_input is None:
            if first_input is None:
                return  # no input seen: a step that began before the hooks (not the script's)
            if self.first_input is None:
                self.first_input = first_input
            start = max(start, first_input)
        self.step_start.append(start)
        self.step_end.append(end)
        self.step_wait.append(wait)
        self.step_transfer.append(transfer)
        self.step_gap.append(max(0.0, (first_input if first_input is not None else start) - start))
        self.step_samples.append(samples)
        if end >= self.beat_due and self.on_beat is not None:
            self.on_beat(end)

    # ---- evaluation
    def _pass(self, now: float) -> EvalPass:
        current = self.passes[-1] if self.passes else None
        closed = self.steps_closed()
        if current is None or current.step != closed:
            current = EvalPass(now, now, step=closed)
            self.passes.append(current)
        return current

    def eval_fetch(self, started: float, asked: float, got: float) -> None:
        """A batch fetched with gradients off; `started`: its iterator's start, for the first of an epoch."""
        current = self._pass(started)
        current.wait_s += got - asked
        current.end = max(current.end, got)

    def eval_forward(self, now: float, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     training: bool, keep_call: bool = True) -> bool:
        """A no-grad forward begins: True when it is evaluation (the caller then times its end). `keep_call`: the
        first one is kept for the evaluation trial (a model's, not a submodule's standing for it)."""
        current = self.passes[-1] if self.passes else None
        if training and (current is None or current.step != self.steps_closed()):
            return False  # a collection phase (module doc)
        current = self._pass(now)
        current.forwards += 1
        if torch.is_autocast_enabled(module_device_type(module)):
            current.autocast_forwards += 1
        if self.eval_call is None and keep_call:
            self.eval_call = (module, args, kwargs)
        return True

    def eval_forward_end(self, now: float) -> None:
        if self.passes:
            self.passes[-1].end = max(self.passes[-1].end, now)

    # ---- epoch starts, the doctor's own time
    def epoch_started(self, started: float, asked: float, got: float) -> None:
        self.epoch_starts.append((started, got, got - asked))

    def doctor(self, seconds: float, what: str, *, end: float | None = None) -> None:
        """The doctor's own `seconds` on `what` ("set-up", "scan", "probe"), ending at `end` (now if None)."""
        now = perf_counter() if end is None else end
        self.intervals.append((DOCTOR, now - seconds, now))
        self.doctor_parts[what] = self.doctor_parts.get(what, 0.0) + seconds

    # ---- the hooks on saves, sleeps and prints
    def install(self, patch: Callable[[Any, str, Any], Any]) -> None:
        """Patch what the ledger times, through `patch(owner, name, replacement)` (the instrumentation's, which
        undoes every patch on exit)."""
        main = threading.main_thread().ident

        def interval(category: str) -> Callable[..., None]:
            def record(started: float, ended: float, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                self.intervals.append((category, started, ended))
            return record

        def write(api: str, file_arg: int | None) -> Callable[..., None]:
            def record(started: float, ended: float, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                if self.save_site is None:
                    self.save_site = site_of("save", sys._getframe(1))
                target = args[file_arg] if file_arg is not None and len(args) > file_arg else \
                    kwargs.get("f", kwargs.get("filename", kwargs.get("checkpoint_id")))
                self.wrote(Write(api, started, ended, _bytes_of(target, args, kwargs),
                                 background=threading.get_ident() != main))
            return record

        patch(builtins, "print", self._timed(builtins.print, main, interval(LOGGING)))
        patch(logging.Logger, "callHandlers", self._timed(logging.Logger.callHandlers, main, interval(LOGGING)))
        patch(time, "sleep", self._timed(time.sleep, main, interval(SLEEP)))
        patch(torch, "save", self._timed(torch.save, main, write("torch.save", 1), every_thread=True))

        def safetensors(module: Any) -> None:
            for name in ("save_file", "save_model"):
                patch(module, name, self._timed(getattr(module, name), main, write("safetensors", 1),
                                                every_thread=True))

        def dcp(module: Any) -> None:
            for name in ("save", "async_save"):
                patch(module, name, self._timed(getattr(module, name), main, write(f"dcp.{name}", None),
                                                every_thread=True))
        # when the script imports them: importing torch.distributed.checkpoint ahead would cost ~0.9 s
        for name, then in (("safetensors.torch", safetensors), ("torch.distributed.checkpoint", dcp)):
            if name in sys.modules:
                then(sys.modules[name])
            else:
                finder = _OnImport(name, then)
                sys.meta_path.insert(0, finder)
                self._finders.append(finder)

    def uninstall(self) -> None:
        """Stop watching for imports (the patches themselves are undone by the instrumentation)."""
        for finder in self._finders:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)
        self._finders.clear()

    def _timed(self, original: Callable[..., Any], main: int | None, record: Callable[..., None], *,
               every_thread: bool = False) -> Callable[..., Any]:
        """`original`, timed and passed to `record(started, ended, args, kwargs)`: on the main thread, unless
        inside another timed call there (a save's own prints are the save's); on other threads too with
        `every_thread` (a background checkpoint write)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            on_main = threading.get_ident() == main
            if (on_main and self._busy) or not (on_main or every_thread):
                return original(*args, **kwargs)
            if on_main:
                self._busy = True
            started = perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if on_main:
                    self._busy = False
                record(started, perf_counter(), args, kwargs)
        return call

    def wrote(self, write: Write) -> None:
        self.last_write = write
        if self.on_beat is not None:
            self.beat_due = 0.0  # the checkpoint's step goes on the store at the next step boundary
        if not write.background:
            self.intervals.append((CHECKPOINT, write.start, write.end))
        totals = self.write_totals
        totals["count"] += 1
        totals["seconds"] += write.end - write.start
        totals["bytes"] += write.bytes or 0
        if len(self.writes) < MAX_WRITES:
            self.writes.append(write)


class _OnImport(importlib.abc.MetaPathFinder):
    """Call `then(module)` once the module `name` is imported (its own finder does the import)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the real finders find it
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, create = loader.exec_module, loader.create_module
        then = self.then

        class Then(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return create(spec)

            def exec_module(self, module: ModuleType) -> None:
                run(module)
                then(module)
        spec.loader = Then()
        return spec


def module_device_type(module: torch.nn.Module) -> str:
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"


def _bytes_of(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The bytes a write produced: the file's (or folder's) size, or a buffer's position; None if unknown."""
    try:
        if isinstance(target, (str, os.PathLike)):
            path = os.fspath(target)
            if os.path.isdir(path):  # a torch.distributed.checkpoint folder
                return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
            return os.path.getsize(path)
        tell = getattr(target, "tell", None)
        if callable(tell):
            return int(tell())
        storage = kwargs.get("storage_writer")
        path = getattr(storage, "path", None)
        return _bytes_of(os.fspath(path), (), {}) if path is not None else None
    except (OSError, TypeError, ValueError):
        return None
