"""Collectives across ranks, timed on the script's process group: how long each rank is blocked in them per step
(exposed communication: its own part of the step, timeline.py), how long they took in all, and which it issued.

Installed by instrument.py through its patch bookkeeping, once torch.distributed is initialized (at its scans: the
script makes its process group after the doctor starts); each hook costs a `perf_counter` pair and a few adds:
- the collective functions of `torch.distributed` (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all,
  barrier), on the module and on `distributed_c10d` (the deprecated names call the new ones there: only the outermost
  call counts). A synchronous call blocks the script's thread in full: exposed. An asynchronous one (`async_op=True`,
  as FSDP2 prefetches its all-gathers) returns a `Work`: the time blocked in its `wait()` (patched on the class) is
  exposed, and its total runs from its issue to its wait's end, an upper bound (it may have finished before the
  wait began: a callback on its future would say when, but costs 15-35 us a collective on gloo here, the backend's
  thread taking the GIL).
- DDP: its reducer all-reduces the gradient buckets from C++, unseen by Python, and waits for them at the end of
  backward. A hook on the loss's first backward node queues an autograd callback, which runs when the backward's
  computation is done, before DDP's own (queued later, at its last bucket): the backward's time after it is DDP's
  exposed communication, the all-reduces' wait and DDP's copy of the reduced buckets into `.grad` (which
  `gradient_as_bucket_view=True` avoids). The all-reduces are counted from DDP's buckets. Their whole time and the
  part of it that overlapped the backward's computation are DDP's own timers (`DdpTimers`), which DDP keeps only at
  its sampled iterations (the first 10, then every 100th): the window's where it holds any, else those before it.
On CUDA with NCCL a collective's wait is the device stream's, not the host's: what is timed here is the host blocked,
and communication the device waits for stays in compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch

# torch.distributed's functions -> the kind of collective they issue
KINDS = {
    "all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
    "all_gather": "all-gather", "all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
    "_all_gather_base": "all-gather", "all_gather_coalesced": "all-gather",
    "reduce_scatter": "reduce-scatter", "reduce_scatter_single": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter", "_reduce_scatter_base": "reduce-scatter",
    "broadcast": "broadcast", "all_to_all": "all-to-all", "all_to_all_single": "all-to-all", "reduce": "reduce",
    "barrier": "barrier",
}


@dataclass
class KindStats:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0  # issue to return, or to its wait's end (asynchronous); DDP's are `untimed`
    exposed_s: float = 0.0  # the script's thread blocked in it
    untimed: int = 0  # issued where only the exposed part is timed (DDP's all-reduces)

    def since(self, earlier: KindStats | None) -> KindStats:
        if earlier is None:
            return dataclasses.replace(self)
        return KindStats(self.count - earlier.count, self.bytes - earlier.bytes, self.seconds - earlier.seconds,
                         self.exposed_s - earlier.exposed_s, self.untimed - earlier.untimed)


# DDP keeps its runtime timers at iterations 1-10, then every 100th (torch's reducer: kDDPRuntimeLoggingSampleRate)
DDP_SAMPLED_FIRST, DDP_SAMPLE_EVERY = 10, 100


@dataclass(frozen=True)
class DdpTimers:
    """DDP's own timers summed over its sampled iterations up to `iteration` (the last sampled), over the DDP models:
    the all-reduces from the first bucket's launch to the last one's end, and the part of that overlapping the
    backward's computation, in seconds."""

    iteration: int = 0
    sampled: int = 0
    comm_s: float = 0.0
    overlap_s: float = 0.0
    in_window: bool = False  # `since` found sampled iterations after the earlier reading

    @classmethod
    def read(cls, models: Any) -> DdpTimers | None:
        found = None
        for model in models:
            try:
                ints = model.logger._get_ddp_logging_data().ints_map
                iteration = int(ints.get("iteration", 0))
                comm, overlap = ints["avg_backward_comm_time"], ints["avg_backward_compute_comm_overlap_time"]
            except Exception:  # an older or changed DDP, or no sampled iteration yet: not timed
                continue
            n = min(iteration, DDP_SAMPLED_FIRST) + iteration // DDP_SAMPLE_EVERY
            timers = cls(iteration, n, comm * n / 1e9, overlap * n / 1e9)
            found = timers if found is None else cls(max(found.iteration, iteration), max(found.sampled, n),
                                                     found.comm_s + timers.comm_s, found.overlap_s + timers.overlap_s)
        return found

    def since(self, earlier: DdpTimers | None) -> DdpTimers:
        """The sampled iterations after `earlier`'s; all of them where none came after (`in_window` tells)."""
        if earlier is None or self.sampled <= earlier.sampled:
            return self
        return DdpTimers(self.iteration, self.sampled - earlier.sampled, self.comm_s - earlier.comm_s,
                         self.overlap_s - earlier.overlap_s, in_window=True)


@dataclass
class CommTotals:
    """What the hooks summed up to one moment, by kind, the steps closed by then, and DDP's own timers."""

    kinds: dict[str, KindStats] = field(default_factory=dict)
    steps: int = 0
    ddp: DdpTimers | None = None

    def since(self, earlier: CommTotals | None) -> CommTotals:
        before = earlier.kinds if earlier is not None else {}
        kinds = {k: s.since(before.get(k)) for k, s in self.kinds.items()}
        ddp = self.ddp.since(earlier.ddp if earlier is not None else None) if self.ddp is not None else None
        return CommTotals({k: s for k, s in kinds.items() if s.count}, self.steps - (earlier.steps if earlier else 0),
                          ddp)


def wrapper_of(module: Any) -> str | None:
    """The data-parallel wrapper a root module is: "ddp", "fsdp2" (fully_shard), "fsdp" (FullyShardedDataParallel)."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    with contextlib.suppress(ImportError):
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        if isinstance(module, FSDPModule):
            return "fsdp2"
        if isinstance(module, FullyShardedDataParallel):
            return "fsdp"
    return None


def _nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The larger of the first two tensors of a collective's arguments (an all-gather's output, a reduce-scatter's
    input, the all-reduced tensor)."""
    size = 0
    for value in (*args[:2], *kwargs.values()):
        if isinstance(value, torch.Tensor):
            size = max(size, value.numel() * value.element_size())
    return size


class Collectives:
    """The hooks and what they summed. `on_exposed(seconds)`: the timeline's `communicated`."""

    def __init__(self, on_exposed: Callable[[float], None], paused: Callable[[], bool]) -> None:
        self.on_exposed, self.paused = on_exposed, paused
        self.kinds: dict[str, KindStats] = {}
        self.installed = False
        self.wrappers: set[str] = set()  # the roots' data-parallel wrappers seen
        self.ddp_bucket_view: bool | None = None  # a DDP root's gradient_as_bucket_view
        self._ddp: weakref.WeakSet[Any] = weakref.WeakSet()
        self._buckets: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()
        self._depth = 0  # inside a timed collective: the calls it makes are its own
        self._pending: dict[int, tuple[str, float]] = {}  # id(work) -> (kind, issued) of async works not waited

    def stats(self, kind: str) -> KindStats:
        stats = self.kinds.get(kind)
        if stats is None:
            stats = self.kinds[kind] = KindStats()
        return stats

    def totals(self, steps: int) -> CommTotals:
        return CommTotals({k: dataclasses.replace(s) for k, s in self.kinds.items()}, steps,  # (a copy: they go on)
                          DdpTimers.read(list(self._ddp)) if self._ddp else None)

    # ---- installation (instrument.py's `_patch`)
    def install(self, patch: Callable[[Any, str, Any], Any]) -> None:
        """Patch the collectives, once torch.distributed is initialized (a no-op before, and after the first time)."""
        dist = torch.distributed
        if self.installed or not dist.is_available() or not dist.is_initialized():
            return
        self.installed = True
        c10d = dist.distributed_c10d
        for name, kind in KINDS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            timed = self._timed(original, kind)
            patch(c10d, name, timed)
            if getattr(dist, name, None) is original:
                patch(dist, name, timed)
        wait = c10d.Work.wait

        def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            started = perf_counter()
            out = wait(work, *args, **kwargs)
            pending = self._pending.pop(id(work), None)
            if pending is not None and not self.paused():
                ended = perf_counter()
                stats = self.stats(pending[0])
                stats.seconds += ended - pending[1]
                stats.exposed_s += ended - started
                self.on_exposed(ended - started)
            return out
        patch(c10d.Work, "wait", timed_wait)

    def _timed(self, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
        work_type = torch.distributed.distributed_c10d.Work

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(*args, **kwargs)
            self._depth += 1
            started = perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                self._depth -= 1
            ended = perf_counter()
            stats = self.stats(kind)
            stats.count += 1
            stats.bytes += _nbytes(args, kwargs)
            blocked = ended - started
            stats.exposed_s += blocked
            if isinstance(out, work_type):  # asynchronous: its wait() ends it
                self._pending[id(out)] = (kind, started)
            else:
                stats.seconds += blocked
            if not self.paused():
                self.on_exposed(blocked)
            return out
        return timed

    # ---- DDP (module doc)
    def saw_roots(self, roots: Any) -> None:
        """The root modules of a scan: which data-parallel wrappers the script uses, and its DDP models."""
        for root in roots:
            wrapper = wrapper_of(root)
            if wrapper is None:
                continue
            self.wrappers.add(wrapper)
            if wrapper == "ddp":
                self._ddp.add(root)
                self.ddp_bucket_view = bool(getattr(root, "gradient_as_bucket_view", False))

    def ddp_backward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], None] | None:
        """Before a backward: where DDP will sync, a mark when its computation ends; the returned function, called
        after the backward returned, books the time since as DDP's exposed all-reduce. None: nothing to time."""
        if not self.installed or not self._ddp:
            return None
        syncing = [m for m in self._ddp if m.require_backward_grad_sync]
        tensors = args[0] if args else kwargs.get("tensors")
        first = tensors if isinstance(tensors, torch.Tensor) else next(iter(tensors or ()), None)
        node = getattr(first, "grad_fn", None)
        if not syncing or node is None:
            return None
        ended: list[float] = []
        engine = torch.autograd.Variable._execution_engine

        def at_start(*_: Any) -> None:
            engine.queue_callback(lambda: ended.append(perf_counter()))
        handle = node.register_prehook(at_start)

        def after() -> None:
            handle.remove()
            if not ended or self.paused():
                return
            blocked = perf_counter() - ended[0]
            stats = self.stats("all-reduce")
            for model in syncing:
                buckets = self._buckets.get(model)
                if buckets is None:
                    buckets, settled = _ddp_buckets(model)
                    if settled:
                        self._buckets[model] = buckets
                stats.count += len(buckets)
                stats.untimed += len(buckets)
                stats.bytes += sum(buckets)
            stats.exposed_s += blocked
            self.on_exposed(blocked)
        return after


def _ddp_buckets(model: Any) -> tuple[tuple[int, ...], bool]:
    """The byte size of each of a DDP model's gradient buckets (one all-reduce each per synced backward), from DDP's
    own logging data (the rebuilt buckets once DDP has rebuilt them, in its second iteration's forward), and whether
    they are settled (no rebuild to come); none when DDP does not say."""
    try:
        data = model.logger._get_ddp_logging_data()
        strs, ints = data.strs_map, data.ints_map
    except Exception:  # an older or changed DDP: the sync is still timed, its buckets not counted
        return (), True
    sizes = strs.get("rebuilt_bucket_sizes") or strs.get("bucket_sizes") or ""
    buckets = tuple(int(s) for s in sizes.replace(" ", "").split(",") if s)
    return buckets, int(ints.get("iteration", 0)) >= 2


def collectives_json(start: CommTotals | None, end: CommTotals | None,
                     collectives: Collectives) -> dict[str, Any] | None:
    """The report's `observed["collectives"]`: over the measured window (the steps closed between the warm-up's end
    and the measured steps' end), per step, each kind's count, bytes and seconds (issue to return, an asynchronous
    one's to its wait's end; None for DDP's all-reduces, whose overlapped part is not timed) and the part of them
    the script was blocked in (exposed); None when no collective was seen."""
    if end is None or not collectives.installed:
        return None
    window = end.since(start)
    steps = max(1, window.steps)
    kinds = {
        kind: {"count_per_step": s.count / steps, "bytes_per_step": s.bytes / steps,
               "seconds_per_step": None if s.untimed else s.seconds / steps,
               "exposed_s_per_step": s.exposed_s / steps}
        for kind, s in sorted(window.kinds.items(), key=lambda item: -item[1].count)}
    if not kinds:
        return None
    timed = [k for k in kinds.values() if k["seconds_per_step"] is not None]
    return {"kinds": kinds, "wrappers": sorted(collectives.wrappers),
            "seconds_per_step": sum(k["seconds_per_step"] for k in timed) if len(timed) == len(kinds) else None,
            "exposed_s_per_step": sum(k["exposed_s_per_step"] for k in kinds.values()),
            "ddp_gradient_as_bucket_view": collectives.ddp_bucket_view,
            "ddp_all_reduce": _ddp_json(window.ddp)}


def _ddp_json(timers: DdpTimers | None) -> dict[str, Any] | None:
    """DDP's all-reduce per iteration (a forward and backward), in all and overlapped with the backward's computation,
    from its own timers over its sampled iterations (module doc); None where DDP kept none."""
    if timers is None or timers.sampled <= 0:
        return None
    return {"seconds_per_iteration": timers.comm_s / timers.sampled,
            "overlapped_s_per_iteration": timers.overlap_s / timers.sampled, "sampled_iterations": timers.sampled,
            "last_sampled_iteration": timers.iteration, "in_window": timers.in_window}
