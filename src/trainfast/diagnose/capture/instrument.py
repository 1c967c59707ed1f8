"""Instrumentation for an unmodified training loop: every patch installed on entry and removed on exit.

What is patched, and why each is cheap enough (one `perf_counter` pair or a counter per call):
- `DataLoader.__iter__` (and trainfast's `TensorLoader.__iter__`): the iterator is wrapped to time each
  `next()` (data wait), the worker start-up of each epoch (`iter()` to first batch) and the batch bytes.
- torch's global optimizer step hook and `torch.autograd.backward`: the signals that end a step (see
  timeline.py for what defines one). `GradScaler.step` counts as an optimizer step when it skips one.
- `__call__` of each root module's class (a root: a module with parameters that no other module contains):
  the model's first forward starts an iteration when no loader feeds it, and its input's leading dimension
  counts samples. Roots are found by walking the garbage collector's objects (~0.1 s, at the first batch, backward,
  optimizer step, sync or `no_grad()` block, and again when the first step closes), not with
  torch's global module hooks: those cost ~2.4 us per submodule call here and make `torch.compile` warn and
  recompile when they are removed.
- `Tensor.item` / `tolist` / `__float__` / `__int__` of a tensor on a device: counted and timed, host syncs.
- `Tensor.to` / `Tensor.cuda` (only where CUDA exists): host time blocked in host-to-device copies and, in the
  measured steps, CUDA events around each copy (devicetime.py): the copy's own time, read at report time.
- `autocast.__enter__`, `GradScaler.step`, JPEG `load()` in this process: what the script uses (mixed
  precision? skipped steps? decoding full-size images?) for the recommendations; compilation is read from
  torch._dynamo's counters instead of patching `torch.compile`, which other libraries wrap themselves, as
  differences between snapshots (instrumentation start, warm-up end, measured steps' end): what the process
  compiled before, another model or an earlier run, is not this loop's.
The model's device is taken from its parameters at its first training forward and at the first optimizer step
(the last word), or meanwhile from a batch or copy on a CUDA device: CUDA events go there, and nowhere before.
"""

from __future__ import annotations

import math
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from time import perf_counter, thread_time
from typing import Any

import torch
from PIL import ImageFile
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader
from torch.utils.data._utils import worker as worker_module
from torch.utils.data._utils.fetch import _IterableDatasetFetcher, _MapDatasetFetcher

from trainfast.diagnose.capture.comms import Collectives, CommTotals
from trainfast.diagnose.capture.devicetime import DeviceTimer
from trainfast.diagnose.capture.ledger import Ledger
from trainfast.diagnose.capture.loaders import batch_info, describe_loader
from trainfast.diagnose.capture.models import batch_axis, root_modules
from trainfast.diagnose.capture.timeline import Timeline, _earliest, _Step
from trainfast.diagnose.capture.worker_clock import WorkerClock
from trainfast.diagnose.records.steps import LoaderStats, WorkerTotals
from trainfast.dynamo import dynamo_counts
from trainfast.flops import FlopCounter
from trainfast.host import queued_s
from trainfast.loader.memory import TensorLoader
from trainfast.loader.threads import ThreadLoader
from trainfast.samples import batch_samples, first_leaf

# Batches made in the main thread are timed for their CPU and run-queue time too (workers.py) when the one before
# took this long: ~13 us a timed batch between steps here (two thread_time and schedstat reads), 1.3 % of a 1 ms
# fetch, but as much as all the other hooks of a tiny step from data already in memory, which needs no such figure
TIMED_WAIT_S = 1e-3


# First scans for the model that may find none before one counts (each walks the GC's objects, ~0.1 s)
MAX_EMPTY_SCANS = 3


@dataclass
class Observations:
    """What the script was seen to use, read when the report is made."""

    device: str | None = None  # the model's device type: "cpu", "cuda", ...
    device_index: int | None = None  # torch's index of the model's CUDA device
    compiled_model: bool = False  # the model called in training is a torch.compile OptimizedModule
    parameters: int = 0
    parameter_dtypes: set[str] = field(default_factory=set)  # floating dtypes of the trained parameters
    conv_weights: int = 0
    conv_weights_channels_last: int = 0
    # conv weights whose strides fit both layouts (a depthwise (C, 1, k, k) kernel, a 1-channel input's): they say
    # nothing of the layout the script chose
    conv_weights_ambiguous: int = 0
    input_layout: str | None = None  # of the model's first 4-D input: "channels_last" or "contiguous"
    autocast: set[tuple[str, str]] = field(default_factory=set)  # (device, dtype) entered and enabled
    scaler_steps: int = 0
    scaler_found_inf: dict[str, torch.Tensor] = field(default_factory=dict)  # per device, summed on it
    # torch._dynamo's counters when instrumentation started, when the warm-up ended and when the measured steps
    # ended (empty: not taken yet)
    dynamo_at_start: dict[str, int] = field(default_factory=dict)
    dynamo_at_warmup: dict[str, int] = field(default_factory=dict)
    dynamo_at_end: dict[str, int] = field(default_factory=dict)
    # the loader workers' own account of their batches (worker_clock.py) when the warm-up and the measured steps ended
    workers_at_warmup: WorkerTotals | None = None
    workers_at_end: WorkerTotals | None = None
    # the collectives' totals (comms.py) when the warm-up and the measured steps ended
    comm_at_warmup: CommTotals | None = None
    comm_at_end: CommTotals | None = None
    jpeg_decoded_pixels: list[int] = field(default_factory=list)
    syncs: int = 0
    threads: int = 0  # torch intra-op threads when training started
    # Filled when the measured steps end (probe_hook.py's gain_probe), not by the hooks. Here, not on the
    # Instrumentation: its attributes are read in every hook, and each one more slows them all (timeline.py)
    trials: Any = None  # the candidate fixes timed on the model (probe.py)
    flop_counter: FlopCounter | None = None  # counting the step after the measured ones
    flops_per_step: int | None = None
    flops_reason: str | None = None  # why no FLOPs were counted

    def scaler_skipped(self) -> int:
        """Optimizer steps the GradScaler skipped (reading it synchronises: report time only)."""
        return int(sum(int(t.item()) for t in self.scaler_found_inf.values()))


class _TimingWorkerLoop:
    """DataLoader's worker entry point, which first makes the worker's fetches time themselves into the clock (in the
    worker process only: nothing there is restored, the process ends with the loop). Pickled for a worker started by
    spawn or forkserver, it is torch's own entry point: the clock's shared memory does not reach such a process."""

    def __init__(self, clock: WorkerClock, original: Callable[..., None]) -> None:
        self.clock, self.original = clock, original

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        for fetcher in (_MapDatasetFetcher, _IterableDatasetFetcher):
            fetcher.fetch = _timed(self.clock, fetcher.fetch)  # type: ignore[method-assign]
        self.original(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _torch_worker_loop, ()


def _torch_worker_loop() -> Callable[..., None]:
    """torch's worker entry point, as a process started afresh has it (unpatched)."""
    return worker_module._worker_loop


def _timed(clock: WorkerClock, fetch: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def timed_fetch(fetcher: Any, index: Any) -> Any:
        with clock.timed():
            return fetch(fetcher, index)
    return timed_fetch


def memory_layout(t: torch.Tensor) -> str:
    """A 4-D tensor's layout: "channels_last", "contiguous" (NCHW), "ambiguous" (strides that fit both: a dimension
    of size 1 where it decides) or "strided" (neither)."""
    nchw, nhwc = t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last)
    return "ambiguous" if nchw and nhwc else "contiguous" if nchw else "channels_last" if nhwc else "strided"


def _to_destination(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of `Tensor.to(*args, **kwargs)` (None: it keeps the tensor's), parsed as torch parses it."""
    try:
        device: torch.device | None = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError):  # a bad call: the real `to` raises it
        return None
    return device


def _cuda_destination(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of `Tensor.cuda(device=None, ...)`: the current CUDA device unless one is named."""
    device = args[0] if args else kwargs.get("device")
    if device is None:
        return torch.device("cuda")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (TypeError, RuntimeError):
        return None


def _torch_caller(frame: Any) -> bool:
    """The code that entered a no_grad/inference_mode block is torch's own: the frame, or, for a function decorated
    with `@torch.no_grad()` (nanoGPT's `estimate_loss`), the frame that called the decorated function."""
    if frame.f_globals.get("__name__") == "torch.utils._contextlib" and frame.f_back is not None:
        frame = frame.f_back
    return bool(frame.f_globals.get("__name__", "").startswith("torch"))


class _TimedIterator:
    """Wraps a loader's iterator: times each `next()`; everything else passes through."""

    def __init__(self, it: Iterator[Any], stats: LoaderStats, inst: Instrumentation, started: float,
                 threads: Any = None) -> None:
        self._it, self._stats, self._inst, self._started = it, stats, inst, started
        self._threads = threads  # a ThreadLoader: its threads time their batches themselves
        self._first = True
        self._slow = False  # the last batch took TIMED_WAIT_S or more (an epoch's first is not timed: its start-up)

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        inst = self._inst
        if inst.scanning:
            inst.discover("batch")
        stats = self._stats
        timed = self._slow and not stats.num_workers  # (TIMED_WAIT_S)
        queued = queued_s() if timed else 0.0
        asked, cpu = perf_counter(), thread_time() if timed else 0.0
        inst.fetching = True  # forwards inside the dataset (a transform module) are not the model's
        try:
            batch = next(self._it)
        finally:
            inst.fetching = False
        got = perf_counter()
        self._slow = got - asked >= TIMED_WAIT_S
        threads = self._threads
        if threads is not None:  # a thread-backed loader's own account of its threads' batches
            made = threads.fetch_stats
            stats.fetch_cpu_s, stats.fetch_wall_s, stats.fetch_queued_s = made.cpu_s, made.wall_s, made.queued_s
            stats.fetch_batches, stats.num_workers = made.batches, made.threads  # (its pool may have grown)
        elif timed:  # its CPU time tells reading from working (workers.py)
            stats.fetch_cpu_s += thread_time() - cpu
            stats.fetch_wall_s += got - asked
            stats.fetch_queued_s += queued_s() - queued
            stats.fetch_batches += 1
        ledger = inst.ledger
        first = self._first
        if first:
            self._first = False
            stats.startup_s.append(got - self._started)
            if stats.batch_bytes is None:
                stats.batch_bytes, stats.image_hw = batch_info(batch)
            if ledger is not None and torch.is_grad_enabled():
                ledger.epoch_started(self._started, asked, got)
        stats.batches += 1
        stats.wait_s += got - asked
        if not torch.is_grad_enabled():  # an evaluation pass (validation runs under no_grad / inference_mode)
            stats.evaluation_batches += 1
            inst.timeline.evaluation_fetch()
            if ledger is not None:  # (an evaluation epoch's start-up is the pass's)
                ledger.eval_fetch(self._started if first else asked, asked, got)
            return batch
        samples = batch_samples(batch, stats.batch_size or 0)
        if stats.batch_size and samples > stats.batch_size:  # not a batch dimension (a first tensor of points)
            samples = stats.batch_size
        inst.timeline.fetched(asked, got, samples)
        if first:
            inst.timeline.epoch_began()
        if not inst.device_timer.settled:
            inst.saw_batch(batch)
        if inst.events is not None and inst.timeline.in_measured_step:
            inst.events.batch_ready()
        return batch

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class Instrumentation:
    """Install the hooks on entry, remove every one on exit (also when the script raises)."""

    def __init__(self, timeline: Timeline, *, time_transfers: bool | None = None,
                 on_loader: Callable[[Any], None] | None = None, device_timer: DeviceTimer | None = None,
                 ledger: Ledger | None = None) -> None:
        self.timeline = timeline
        self.ledger = ledger  # a whole run's (ledger.py): every step, evaluation pass, save, print and sleep
        self.on_loader = on_loader  # called before each iter() of a loader: the pre-flight checks
        self.fetching = False  # inside a timed loader's next()
        self.optimizer_stepped = 0  # optimizer steps seen by the hook (a GradScaler's skipped step is not one)
        timeline.on_close = self._step_closed
        self.time_transfers = torch.cuda.is_available() if time_transfers is None else time_transfers
        # CUDA events on the model's device; `events` is the timer once that device is known to be a CUDA one
        # (None before and on the CPU: the hot paths test it and skip)
        self.device_timer = device_timer or DeviceTimer()
        self.events: DeviceTimer | None = None
        self._described: set[int] = set()  # the optimizers whose first step described their model
        self.loaders: list[LoaderStats] = []
        self.observed = Observations()
        self._parameters: dict[int, torch.Tensor] = {}  # described, by id (kept alive: ids stay unique)
        self._convs: set[int] = set()
        self._by_loader: dict[int, LoaderStats] = {}
        self._keep_alive: list[Any] = []  # loaders described: their id() must stay unique while measuring
        self._undo: list[Callable[[], None]] = []
        self.worker_clock = WorkerClock()  # loader workers forked while measuring time their batches into it
        self._roots: dict[int, int] = {}  # id of each root module -> where the batch is in its input
        self._root_refs: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._discovered_on: set[str] = set()
        self._empty_scans = 0  # first scans that found no model yet (a trigger before it was built)
        self.scanning = True  # until the second scan (when the first step closes): hot paths skip discover()
        # A root reached only through methods other than forward (a wrapper forwarding __getattr__, as Fabric's
        # does, then agent.get_action(x)): its submodules' outermost calls stand for its forwards (`_watch_entries`)
        self._entries: dict[int, nn.Module] = {}
        self._entry_patches: list[Callable[[], None]] = []  # the undo of each class watched for entries only
        self._in_entry = False
        self.paused = False  # the doctor's own work (probe.py): the hooks pass it through
        # collectives across ranks (comms.py): installed at a scan once the script's process group is up
        self.collectives = Collectives(timeline.communicated, lambda: self.paused)
        # each root's first training call: (module, (args, kwargs)), the replay's input (probe.py)
        self.last_calls: dict[int, tuple[nn.Module, tuple[tuple[Any, ...], dict[str, Any]]]] = {}

    # ---- patch bookkeeping
    def _patch(self, owner: Any, name: str, replacement: Any) -> Any:
        had_own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, replacement)

        def undo() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # fall back to the inherited attribute, exactly as before
        self._undo.append(undo)
        return original

    def __enter__(self) -> Instrumentation:
        try:
            self._install()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ledger is not None:
            self.ledger.uninstall()
        while self._undo:
            self._undo.pop()()
        self.timeline.finish()  # the last step, waiting for an iteration that will not come
        if not self.observed.dynamo_at_end:  # the measured steps ended with the run (no step limit, or too few)
            self.observed.dynamo_at_end = dynamo_counts()
            self.observed.workers_at_end = self.worker_clock.totals()
            self.observed.comm_at_end = self.collectives.totals(self.timeline.closed_steps)
        observed = self.observed
        if observed.flop_counter is not None:  # the run ended inside the counted step: a part of a step is no count
            observed.flop_counter.stop()
            observed.flop_counter, observed.flops_reason = None, "the script ended before the counted step did"
        # torch may keep our hooks (and so self) alive: never the script's loaders, models or batches
        self._keep_alive.clear()
        self._parameters.clear()
        self._entries.clear()
        self.last_calls.clear()

    def stats_for(self, loader: Any) -> LoaderStats:
        stats = self._by_loader.get(id(loader))
        if stats is None:
            stats = describe_loader(loader, len(self.loaders))
            self._by_loader[id(loader)] = stats
            self.loaders.append(stats)
        return stats

    # ---- the hooks
    def _install(self) -> None:
        timeline, observed = self.timeline, self.observed
        if self.ledger is not None:
            self.ledger.steps_closed = lambda: timeline.closed_steps
            self.ledger.install(self._patch)

        def wrap_iter(original: Callable[[Any], Iterator[Any]]) -> Callable[[Any], Iterator[Any]]:
            def timed_iter(loader: Any) -> Iterator[Any]:
                if self.on_loader is not None:
                    self.on_loader(loader)
                started = time.perf_counter()
                it = original(loader)
                stats = self.stats_for(loader)
                if stats.epochs == 0:
                    self._keep_alive.append(loader)
                stats.epochs += 1
                return _TimedIterator(it, stats, self, started, loader if isinstance(loader, ThreadLoader) else None)
            return timed_iter

        for owner in (DataLoader, TensorLoader, ThreadLoader):
            self._patch(owner, "__iter__", wrap_iter(owner.__iter__))
        # workers forked from here on time their batches (the main process's fetches are left as they are)
        self._patch(worker_module, "_worker_loop", _TimingWorkerLoop(self.worker_clock, worker_module._worker_loop))

        def step_begins(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            timeline._in_optimizer = True  # (timeline.optimizer_step_begins, inlined: ~0.3 us a step)

        def on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self.paused:
                return
            self.optimizer_stepped += 1
            if id(optimizer) not in self._described:
                self._describe_model(optimizer)
            if self.scanning:
                self.discover("optimizer step")
            timeline.optimizer_step(optimizer)
            if self.events is not None:
                self.events.work_done()

        handle = register_optimizer_step_post_hook(on_step)
        self._undo.append(handle.remove)
        handle = register_optimizer_step_pre_hook(step_begins)
        self._undo.append(handle.remove)
        self._undo.append(self._roots.clear)
        backward = torch.autograd.backward

        collectives = self.collectives

        def counted_backward(*args: Any, **kwargs: Any) -> Any:
            ddp = collectives.ddp_backward(args, kwargs) if collectives.installed else None
            out = backward(*args, **kwargs)
            if ddp is not None:
                ddp()
            if self.paused:
                return out
            if self.scanning:
                self.discover("backward")
            timeline.backward()
            if self.events is not None:
                self.events.work_done()
            return out
        self._patch(torch.autograd, "backward", counted_backward)
        for mode in (torch.no_grad, torch.inference_mode):  # a loop that only evaluates still finds its model
            enter = mode.__enter__

            def entered(ctx: Any, _enter: Callable[[Any], Any] = enter) -> Any:
                if self.scanning and not _torch_caller(sys._getframe(1)):
                    self.discover("no_grad")  # (nn.init's no_grad, mid-construction, is not a trigger)
                return _enter(ctx)
            self._patch(mode, "__enter__", entered)
        observed.dynamo_at_start = dynamo_counts()
        if timeline.warmup_steps == 0:
            observed.dynamo_at_warmup = observed.dynamo_at_start

        for name in ("item", "tolist", "__float__", "__int__"):
            self._patch(torch.Tensor, name, self._counting_sync(getattr(torch.Tensor, name)))
        if self.time_transfers:
            for name, destination in (("to", _to_destination), ("cuda", _cuda_destination)):
                self._patch(torch.Tensor, name, self._timed_copy(getattr(torch.Tensor, name), destination))
        self._observe_precision_and_compile()

    def end_step(self) -> None:
        """End a step now: for callers that define steps themselves (`Timeline(explicit_steps=True)`)."""
        self._work_done()
        self.timeline.step_end()

    def _work_done(self) -> None:
        if self.events is not None:
            self.events.work_done()

    def _step_closed(self, measured: bool, step: _Step) -> None:
        """The timeline closed a step: keep the compile counters and CUDA events in step with it, and give a whole
        run's ledger its span."""
        observed, timeline = self.observed, self.timeline
        ledger = self.ledger
        if ledger is not None:
            ledger.loader_fed = timeline.loader_fed
            first_input = step.first_ask if step.first_ask is not None else _earliest(step.first_forward,
                                                                                      step.first_no_grad)
            ledger.step(step.start, step.end, step.wait, step.transfer, first_input,
                        step.samples or step.forward_samples, step.opening)
        if not observed.dynamo_at_warmup and timeline.measuring:
            observed.dynamo_at_warmup = dynamo_counts()
            observed.workers_at_warmup = self.worker_clock.totals()
            observed.comm_at_warmup = self.collectives.totals(timeline.closed_steps)
        if measured and not observed.dynamo_at_end and timeline.phases[0].done:
            observed.dynamo_at_end = dynamo_counts()
            observed.workers_at_end = self.worker_clock.totals()
            observed.comm_at_end = self.collectives.totals(timeline.closed_steps)
        if self.scanning:
            self.discover("step")
        if self.events is not None:
            self.events.step_closed(measured)
        elif (ledger is None and not self.scanning and observed.dynamo_at_warmup and self.device_timer.settled
              and (observed.dynamo_at_end or timeline.max_steps is None)):  # (no step limit: __exit__ takes it)
            timeline.on_close = None  # nothing left to do per step: save the call (~0.5 us)

    # ---- the model's device
    def _model_on(self, device: torch.device) -> None:
        observed = self.observed
        observed.device = device.type
        observed.device_index = device.index if device.type == "cuda" else None
        self.device_timer.saw_model(device)
        self.events = self.device_timer if self.device_timer.device is not None else None

    def _saw_model(self, module: nn.Module) -> None:
        """The model's first training forward: where its parameters are, and whether it is compiled."""
        param = next(module.parameters(), None)
        if param is not None:
            self.observed.compiled_model = type(module).__name__ == "OptimizedModule"  # without importing dynamo
            self._model_on(param.device)

    def _saw_tensor(self, device: torch.device) -> None:
        self.device_timer.saw_tensor(device)
        if self.observed.device is None and self.device_timer.device is not None:
            self.observed.device, self.observed.device_index = "cuda", self.device_timer.device.index
        self.events = self.device_timer if self.device_timer.device is not None else None

    def saw_batch(self, batch: Any) -> None:
        """A training batch before the model was seen: a loader that yields CUDA tensors is CUDA work."""
        leaf = first_leaf(batch)
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":  # (numpy arrays live on the host)
            self._saw_tensor(leaf.device)

    def discover(self, trigger: str) -> None:
        """Hook the root modules at the first batch, backward, optimizer step, sync or `no_grad()` block, and
        again when the first step closes: a module found mid-construction the first time (a `no_grad()` inside
        `nn.init`, a sync in `__init__`) is by then part of its model, which is the root. A first scan that finds
        no module at all (a trigger before any model was built) does not count, up to `MAX_EMPTY_SCANS` times."""
        if trigger == "step":
            if "step" in self._discovered_on:
                return
        elif self._discovered_on:
            return
        self._discovered_on.add(trigger)
        self.scanning = "step" not in self._discovered_on
        started = perf_counter()
        # A module found the first time that is now inside a model drops out: its model is the root.
        self._roots.clear()
        self._root_refs.clear()
        for module in root_modules():
            if isinstance(module, torch.jit.ScriptModule):  # its __call__ is TorchScript's
                continue
            self._roots[id(module)] = batch_axis(module)
            self._root_refs[id(module)] = module
            self._watch_calls(type(module))
        self.collectives.install(self._patch)  # (once, and only once the script's process group is up)
        self.collectives.saw_roots(self._root_refs.values())
        if trigger == "backward" and self._roots and not self.timeline.training_forwards:
            # the first backward, the hooks put on its model only now: its forward ran unseen, before them
            self.timeline.forwards += 1
            self.timeline.training_forwards += 1
        if not self._roots and trigger != "step" and self._empty_scans < MAX_EMPTY_SCANS:
            self._empty_scans += 1  # no model exists yet: the next trigger scans again
            self._discovered_on.discard(trigger)
        if not self.timeline.forwards:
            self._watch_entries()
        self.doctor_time(perf_counter() - started, "scan")

    def doctor_time(self, seconds: float, what: str) -> None:
        """The doctor itself just spent `seconds` on `what` (a scan, the timed candidates): not the script's."""
        self.timeline.pause(seconds)
        if self.ledger is not None:
            self.ledger.doctor(seconds, what)

    def _watch_entries(self) -> None:
        """No root was called yet: the loop may reach its model through other methods (a wrapper's `__getattr__`,
        `agent.get_action_and_value(x)`, as Fabric's PPO does). Watch the roots' submodules too, until a root is
        called: the outermost call of one stands for a forward of its root. Dropped at a root's first call: a
        watched class costs ~0.3 us per call of any of its instances."""
        self._entries.clear()
        root_classes = {type(root) for root in self._root_refs.values()}
        for root in list(self._root_refs.values()):
            for module in root.modules():
                if module is not root and not isinstance(module, torch.jit.ScriptModule):
                    self._entries[id(module)] = module
                    cls = type(module)
                    if cls not in root_classes and self._watch_calls(cls):
                        self._entry_patches.append(self._undo[-1])

    def _drop_entries(self) -> None:
        """A root was called: its forwards are seen; the submodules' classes get their own __call__ back."""
        self._entries.clear()
        while self._entry_patches:
            undo = self._entry_patches.pop()
            undo()
            self._undo.remove(undo)

    def _watch_calls(self, cls: type[nn.Module]) -> bool:
        """Wrap `cls.__call__` (once per class, inherited by subclasses): the roots' forwards go to `_on_forward`.

        Why not a forward pre-hook on each root: a module with hooks takes `_call_impl`'s slow path (~10 us per
        call here, 4 % of a tiny step), and `torch.save(model)` would pickle the hook and fail.
        """
        if getattr(cls.__call__, "_trainfast_watch", False):
            return False
        original = cls.__call__
        roots, on_forward = self._roots, self._on_forward

        entries = self._entries

        def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if id(module) in roots:
                if entries:
                    self._drop_entries()
                if on_forward(module, args, kwargs):  # an evaluation forward of a whole run: its end is timed
                    try:
                        return original(module, *args, **kwargs)
                    finally:
                        self.ledger.eval_forward_end(perf_counter())  # type: ignore[union-attr]
            elif entries and id(module) in entries and not self._in_entry:
                on_forward(module, args, kwargs, root=False)
                self._in_entry = True  # its submodules' calls are inside this forward
                try:
                    return original(module, *args, **kwargs)
                finally:
                    self._in_entry = False
            return original(module, *args, **kwargs)
        call._trainfast_watch = True  # type: ignore[attr-defined]
        self._patch(cls, "__call__", call)
        return True

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], root: bool = True) -> bool:
        """A root's forward begins (or a submodule's standing for it: `root` False): True when a whole run's ledger
        times it as evaluation."""
        if self.fetching or self.paused:  # a module inside the dataset (a transform), not the model
            return False
        timeline = self.timeline
        if not torch.is_grad_enabled():  # an evaluation pass, or a collection phase (timeline.py)
            now = perf_counter()
            timeline.evaluation_forward(now, module.training)
            return self.ledger is not None and self.ledger.eval_forward(now, module, args, kwargs, module.training,
                                                                        keep_call=root)
        if id(module) not in self.last_calls:  # (a lookup, not a store, per forward: ~0.1 us less per step)
            self.last_calls[id(module)] = (module, (args, kwargs))
            self._saw_input_layout(args, kwargs)
        if not self.device_timer.settled:
            self._saw_model(module)
        if timeline.loader_fed:  # batches come from a loader: its fetches start iterations and count samples
            timeline.forwards += 1
            timeline.training_forwards += 1
            return False
        first = args[0] if args else None
        timeline.forward(perf_counter(), self._input_samples(module, args, kwargs),
                         first if isinstance(first, torch.Tensor) else None)
        if self.events is not None and timeline.in_measured_step:
            self.events.batch_ready()
        return False

    def _saw_input_layout(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The layout of a root's first 4-D floating input (once per root): a script that feeds channels_last images
        uses the practice, whatever its weights' strides say."""
        image = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() == 4
                      and t.is_floating_point()), None)
        layout = memory_layout(image) if image is not None else None
        if layout in ("channels_last", "contiguous") and self.observed.input_layout != "channels_last":
            self.observed.input_layout = layout

    def _input_samples(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        first = args[0] if args else None
        axis = self._roots.get(id(module), 0)
        if type(first) is torch.Tensor and first.ndim and not axis:  # the usual case, fast
            return int(first.shape[0])
        if axis:
            leaf = first_leaf((args, kwargs))
            if leaf is not None and leaf.ndim in (2, 3):  # (seq_len, batch[, features])
                return int(leaf.shape[1])
        return batch_samples((args, kwargs), 0)

    def _counting_sync(self, original: Callable[..., Any]) -> Callable[..., Any]:
        timeline, observed = self.timeline, self.observed

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # A CPU tensor's value is at hand (no device to wait for), a dataset's reads inside a loader's next()
            # are data wait, and torch's own calls (AdamW reading its step count) are not the script's to fix.
            if (tensor.device.type == "cpu" or self.fetching or self.paused
                    or sys._getframe(1).f_globals.get("__name__", "").startswith("torch")):
                return original(tensor, *args, **kwargs)
            if self.scanning:
                self.discover("sync")
            started = time.perf_counter()
            out = original(tensor, *args, **kwargs)
            observed.syncs += 1
            timeline.synced(time.perf_counter() - started)
            return out
        return counted

    def _timed_copy(self, original: Callable[..., Any],
                    destination: Callable[[tuple[Any, ...], dict[str, Any]], torch.device | None]
                    ) -> Callable[..., Any]:
        """Host time blocked in each host-to-device copy and, in the measured steps, CUDA events around it on the
        destination's current stream (its own device time: the host time includes waiting for queued kernels)."""
        timeline, timer = self.timeline, self.device_timer

        def timed(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.fetching or self.paused or tensor.device.type != "cpu":  # in a loader's next(): data wait already
                return original(tensor, *args, **kwargs)
            events = None
            if timeline.in_measured_step:
                device = destination(args, kwargs)
                if device is not None and device.type == "cuda":
                    events = timer.copy_started(device)
            started = perf_counter()
            out = original(tensor, *args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type == "cuda":
                timeline.transferred(perf_counter() - started, None if events is None else timer.copy_ended(events))
                if not timer.settled:
                    self._saw_tensor(out.device)
            return out
        return timed

    def _observe_precision_and_compile(self) -> None:
        observed = self.observed
        autocast_cls = torch.amp.autocast_mode.autocast
        enter = autocast_cls.__enter__

        def autocast_enter(ctx: Any) -> Any:
            if getattr(ctx, "_enabled", False) and not self.paused:  # (not the doctor's own trials: probe.py)
                observed.autocast.add((str(ctx.device), str(ctx.fast_dtype).replace("torch.", "")))
            return enter(ctx)  # type: ignore[no-untyped-call]
        self._patch(autocast_cls, "__enter__", autocast_enter)

        scaler_cls = torch.amp.GradScaler
        scaler_step = scaler_cls.step

        def step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            stepped = self.optimizer_stepped
            out = scaler_step(scaler, optimizer, *args, **kwargs)
            if self.optimizer_stepped == stepped:  # inf/NaN gradients: the scaler skipped the step, still a step
                self.timeline.optimizer_step(optimizer)
                self._work_done()
            if scaler.is_enabled():
                observed.scaler_steps += 1
                state = scaler._per_optimizer_states.get(id(optimizer), {})
                for found in state.get("found_inf_per_device", {}).values():  # summed on the device, no sync
                    key = str(found.device)
                    total = observed.scaler_found_inf.get(key)
                    observed.scaler_found_inf[key] = found.detach().float() if total is None else total + found
            return out
        self._patch(scaler_cls, "step", step)

        load = ImageFile.ImageFile.load

        def jpeg_load(image: Any) -> Any:
            out = load(image)
            if getattr(image, "format", None) == "JPEG" and len(observed.jpeg_decoded_pixels) < 10_000:
                observed.jpeg_decoded_pixels.append(image.size[0] * image.size[1])
            return out
        self._patch(ImageFile.ImageFile, "load", jpeg_load)

    def _describe_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At each optimizer's first step: the parameters it trains and the convolutions of their models, added to
        what earlier optimizers described (a GAN's generator and discriminator have one each)."""
        observed = self.observed
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            return
        first = not self._described
        self._described.add(id(optimizer))
        if first:
            self._model_on(params[0].device)
            observed.threads = torch.get_num_threads()
        new = [p for p in params if id(p) not in self._parameters]
        self._parameters.update((id(p), p) for p in new)
        observed.parameters += sum(p.numel() for p in new)
        observed.parameter_dtypes.update(str(p.dtype).replace("torch.", "") for p in new if p.is_floating_point())
        # the convolutions of the models this optimizer trains, frozen ones too: channels_last speeds them all up
        stepped = {id(p) for p in params}
        models = [m for m in self._root_refs.values() if any(id(p) in stepped for p in m.parameters())]
        weights = [p for m in models for p in m.parameters()] if models else params
        convs = [p for p in weights if p.dim() == 4 and math.prod(p.shape[2:]) > 1 and id(p) not in self._convs]
        self._convs.update(id(p) for p in convs)
        observed.conv_weights += len(convs)
        for p in convs:
            layout = memory_layout(p)
            if layout == "channels_last":
                observed.conv_weights_channels_last += 1
            elif layout == "ambiguous":
                observed.conv_weights_ambiguous += 1
