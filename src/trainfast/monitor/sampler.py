"""`Monitor`: a daemon thread that samples every source at a fixed interval into a ring buffer.

    with Monitor(interval_s=0.5) as monitor:
        trainer.fit(train, val)
    print(monitor.summary()["cpu.percent"].mean, monitor.gpu_sawtooth(), monitor.unavailable)

Cost: one PsutilSource sample takes ~0.6 ms (2 cores, 70 processes; most of it the /proc scan for
workers) and NVML adds a few library calls per GPU, so at the default 0.5 s the thread holds the GIL
well under 1 % of the time. The workers' private memory costs more (~20 us per MiB of their RSS, in the kernel,
outside the GIL) and is read only as often as keeps it within 1 % of the machine's CPU (PRIVATE_CPU_SHARE).
Sampling much faster gains little: NVML's utilisation figure is itself an average over the last 1/6-1 s.
7200 samples at 0.5 s keep the last hour.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from contextlib import suppress
from types import TracebackType

from trainfast.monitor.analysis import Stats
from trainfast.monitor.series import Series, cuda_indices
from trainfast.monitor.sources import NvmlSource, PsutilSource, Source, TorchCudaSource, cuda_identity

log = logging.getLogger("trainfast")

THREAD_NAME = "trainfast-monitor"
# stop() waits this long for a sample in progress; a source stuck in the driver is left to the daemon
# thread (it cannot keep the process alive) rather than blocking the end of training.
JOIN_TIMEOUT_S = 5.0

Sample = tuple[float, dict[str, float]]


def default_sources() -> list[Source]:
    """System and workers (psutil), every GPU (NVML), this process's CUDA allocator (torch)."""
    return [PsutilSource(), NvmlSource(), TorchCudaSource()]


class Monitor:
    """Samples `sources` every `interval_s` seconds on a daemon thread named "trainfast-monitor" and keeps
    the last `capacity` samples as `(time.monotonic(), {metric: value})`.

    Unavailable sources are left out and listed in `unavailable` ({name: reason}). A source whose
    `sample()` raises is disabled, closed and listed in `errors` ({name: "Type: message"}): monitoring
    must never be what stops a training run. A Monitor runs once: `stop()` closes the sources.
    """

    def __init__(self, interval_s: float = 0.5, capacity: int = 7200, sources: Iterable[Source] | None = None
                 ) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not (
                math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a finite number of seconds > 0 (e.g. 0.5), got {interval_s!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (samples kept; 7200 at 0.5 s is one hour), "
                             f"got {capacity!r}")
        self.interval_s = float(interval_s)
        self.capacity = capacity
        self.unavailable: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self._sources: list[Source] = []
        self._nvml: NvmlSource | None = None  # kept when disabled: its GPU identities name the gpu{i} series
        for source in default_sources() if sources is None else sources:
            if source.available:
                self._sources.append(source)
                if isinstance(source, NvmlSource) and self._nvml is None:
                    self._nvml = source
            else:
                self.unavailable[source.name] = getattr(source, "unavailable_reason", None) or "unavailable"
                with suppress(Exception):
                    source.close()
        self._buffer: deque[Sample] = deque(maxlen=capacity)
        # deque.append is atomic, but copying a deque while another thread appends raises RuntimeError.
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self._stopped = False

    @property
    def sources(self) -> tuple[Source, ...]:
        """The sources still being sampled."""
        return tuple(self._sources)

    @property
    def started_at(self) -> float | None:
        """`time.monotonic()` when sampling started: `series()` times are seconds since then."""
        return self._started_at

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Monitor:
        """Start sampling (the first sample is taken at once); a no-op while already running."""
        if self._stopped:
            raise RuntimeError("this Monitor has been stopped and its sources closed; a Monitor runs once, "
                               "create a new one to sample again")
        if self._thread is None:
            self._started_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Stop sampling, join the thread and close the sources; a no-op when already stopped. The samples
        stay readable."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("monitor: a sample has not returned after %.1f s; leaving it to the daemon thread "
                            "without closing the sources", timeout_s)
                return
        for source in self._sources:
            with suppress(Exception):
                source.close()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop_event.is_set():
            self._sample_once()
            # A fixed schedule (t0 + k * interval) keeps samples evenly spaced however long sampling takes;
            # after a stall (a slow source, a suspended process) skip the missed ticks instead of bursting.
            next_at += self.interval_s
            now = time.monotonic()
            if next_at <= now:
                next_at = now + self.interval_s
            self._stop_event.wait(next_at - now)

    def _sample_once(self) -> None:
        taken_at = time.monotonic()
        values: dict[str, float] = {}
        for source in list(self._sources):
            try:
                values.update(source.sample())
            except Exception as exc:
                self._disable(source, exc)
        with self._lock:
            self._buffer.append((taken_at, values))

    def _disable(self, source: Source, exc: Exception) -> None:
        self._sources.remove(source)
        self.errors[source.name] = f"{type(exc).__name__}: {exc}"
        log.warning("monitor: source %r disabled after its sample() raised %s", source.name, self.errors[source.name])
        with suppress(Exception):
            source.close()

    def samples(self) -> list[Sample]:
        """A copy of the buffered samples, oldest first."""
        with self._lock:
            return [(taken_at, dict(values)) for taken_at, values in self._buffer]

    def _by_metric(self) -> dict[str, tuple[list[float], list[float]]]:
        with self._lock:
            snapshot = list(self._buffer)
        start = self._started_at if self._started_at is not None else 0.0
        series: dict[str, tuple[list[float], list[float]]] = {}
        for taken_at, values in snapshot:
            for metric, value in values.items():
                times, vals = series.setdefault(metric, ([], []))
                times.append(taken_at - start)
                vals.append(value)
        return series

    def frozen(self, cuda_devices: Iterable[int] = ()) -> Series:
        """What was sampled so far, frozen (series.py), with the NVML index of every CUDA device the allocator was
        sampled on and of `cuda_devices` (the model's), matched now (`nvml_index`)."""
        by_metric = self._by_metric()
        devices = cuda_indices(list(by_metric)) | set(cuda_devices)
        return Series(self._started_at, by_metric, dict(self.unavailable),
                      {i: self.nvml_index(i) for i in sorted(devices)})

    def metrics(self) -> list[str]:
        """The names of every metric in the buffer, sorted."""
        return sorted(self._by_metric())

    def series(self, metric: str) -> tuple[list[float], list[float]]:
        """(seconds since start(), values) of one metric, for the samples that have it."""
        return Series(self._started_at, self._by_metric()).series(metric)

    def summary(self) -> dict[str, Stats]:
        """`Stats` of every metric over the buffered samples, by metric name (sorted)."""
        return Series(self._started_at, self._by_metric()).summary()

    def nvml_index(self, cuda_index: int) -> int | None:
        """The NVML index `j` (metrics `gpu{j}.*`) of torch's `cuda:{cuda_index}`, matched by UUID or PCI
        location (CUDA_VISIBLE_DEVICES and CUDA's own ordering renumber GPUs); None without NVML, before this
        process initialised CUDA, or when no GPU matches."""
        identity = cuda_identity(cuda_index) if self._nvml is not None else None
        return None if identity is None or self._nvml is None else self._nvml.index_of(identity)

    def gpu_sawtooth(self) -> dict[str, bool]:
        """For each `gpu{i}.util`: does it swing between idle and busy (an input-bound run)?"""
        return Series(self._started_at, self._by_metric()).gpu_sawtooth()
