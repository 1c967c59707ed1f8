"""Where samples come from: the `Source` protocol and its implementations.

Each source returns only the metrics it could read this time, as `{"<device>.<quantity>": value}` with units
in the name where they are not a percentage. A source that cannot work on this machine says so through
`available = False` and `unavailable_reason` instead of raising, so a monitor built on a laptop, a CPU
container and an 8-GPU node alike never fails to start.

Indices: `gpu{i}` is NVML's index (every GPU on the host, PCI order, ignoring CUDA_VISIBLE_DEVICES);
`cuda{i}` is torch's index (only the visible GPUs, in CUDA's order). They can name different GPUs: match them
by identity (`cuda_identity`, `NvmlSource.index_of`), never by number.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from typing import Any, NamedTuple, Protocol, runtime_checkable

import psutil
import torch

log = logging.getLogger("trainfast.monitor")

# `workers.private_bytes` is read from /proc/<pid>/smaps_rollup (Linux 4.14+), which the kernel fills by walking
# the process's page tables: 20-45 us of CPU per MiB of RSS measured here (2.9 ms for an idle 177 MiB worker,
# 13 ms for an idle 615 MiB one, 16-30 ms for two 324 MiB workers busy copying pages; RSS from statm: 10 us whatever
# the size), so eight 2 GiB workers would cost ~0.3-0.7 s a pass. A pass is taken only once the CPU time the
# previous one took is at most PRIVATE_CPU_SHARE of the machine's CPU time since: on 2 cores, at every sample
# (0.5 s) for two small workers, every 0.8-1.5 s for the two 324 MiB ones. Runs too short for enough passes get
# no copy-on-read figure rather than a wrong one.
PRIVATE_CPU_SHARE = 0.01
_SMAPS_ROLLUP = os.path.exists(f"/proc/{os.getpid()}/smaps_rollup")
_SCHEDSTAT = os.path.exists(f"/proc/{os.getpid()}/schedstat")


def _run_delay_s(pid: int) -> float | None:
    """Seconds process `pid`'s main thread has spent runnable but waiting for a core (the kernel's run-queue delay,
    second field of /proc/<pid>/schedstat); None where the kernel does not keep it or the process is gone."""
    if not _SCHEDSTAT:
        return None
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _private_bytes(pid: int) -> float:
    """Memory of process `pid` that no other process maps, shared memory left out: Private_Clean + Private_Dirty
    (+ Private_Hugetlb), psutil's USS, less Pss_Shmem (tensors a loader worker is handing over through /dev/shm,
    private to it until the receiver maps them). Raises OSError when the process cannot be read."""
    private = shmem = 0
    with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:  # lines like b"Private_Dirty:     11340 kB"
        for line in rollup:
            if line.startswith(b"Private_"):
                private += int(line.split()[1])
            elif line.startswith(b"Pss_Shmem:"):
                shmem += int(line.split()[1])
    return float(max(0, private - shmem) * 1024)


@runtime_checkable
class Source(Protocol):
    name: str
    available: bool

    def sample(self) -> dict[str, float]:
        """The metrics readable now; missing keys mean "could not read", never an error."""
        ...

    def close(self) -> None:
        """Release what the source holds (NVML's handle); idempotent."""
        ...


def _busy_percent(before: Any, after: Any) -> float:
    """Busy share (%) of one core between two `psutil.cpu_times(percpu=True)` entries, counted the way
    psutil and htop count it: guest time is already inside user/nice on Linux, and iowait is idle.
    Deltas are taken per field first: the totals are seconds since boot, and subtracting those left ~2e-10 %
    of float noise on an idle core."""
    # Counters can step backwards by a tick (psutil issue #392): clamp each delta at 0 as top does.
    delta = {field: max(0.0, new - old) for (field, old), new in zip(before._asdict().items(), after, strict=True)}
    total = math.fsum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
    busy = total - delta.get("idle", 0.0) - delta.get("iowait", 0.0)
    return min(100.0, max(0.0, 100.0 * busy / total)) if total > 0 else 0.0


# Descendants that serve the process rather than load its data: in a command line, they are not workers
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker",
           "torch._inductor.compile_worker")


class PsutilSource:
    """System CPU and RAM, this process, and its descendant processes (DataLoader workers) through psutil.

    Metrics: `cpu.percent` (mean over cores) and `cpu{i}.percent` per core (unless `per_core=False`),
    `ram.used_bytes`, `ram.percent`, `proc.cpu_percent` (100 = one core busy, so it can exceed 100),
    `proc.rss_bytes`, and over the descendants `workers.count`, `workers.cpu_percent` (sum),
    `workers.rss_bytes` (sum), `workers.max_rss_bytes`, `workers.private_bytes` (sum), `workers.started` and
    `workers.queued_percent` (sum: the time the workers were runnable but waiting for a core, Linux's schedstat).
    With `workers.cpu_percent` it tells workers that compute (CPU), that wait for a core (queued) and that wait on
    something else (the rest of their time: a read from storage, a lock, the next index).

    Percentages are over the time since the previous sample (the first covers the time since construction).
    Descendants that are helpers, not workers, are left out (`HELPERS`: multiprocessing's resource tracker, which
    lives as long as the process once anything started one, its forkserver, inductor's compile workers); the
    forkserver's own children, the workers it forks, are counted. Forked workers share pages with the parent and RSS
    counts those in each, so `workers.rss_bytes` overstates the memory really used. Nor does its growth tell
    copy-on-read: a forked worker's RSS starts with every page it inherited, so copying one (a write, or a Python
    object's refcount touched) swaps a shared page for a private one and leaves RSS as it was, while workers
    restarted between two samples (non-persistent workers, at each epoch) start at the parent's RSS of that moment
    with no change in `workers.count`. `workers.private_bytes` is what those copies grow: the memory that only the
    workers map, shared memory (batches in flight through /dev/shm) left out. It is read on Linux only, and not at every
    sample when reading it is slow (see PRIVATE_CPU_SHARE): a sample may lack it. `workers.started` counts the
    descendants seen since construction: when it changes, the workers are not the same ones, even if as many.
    """

    def __init__(self, pid: int | None = None, per_core: bool = True) -> None:
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 0):
            raise ValueError(f"pid must be a process id (an int >= 0) or None for this process, got {pid!r}")
        self.name = "psutil"
        self.available = True
        self.unavailable_reason: str | None = None
        self.per_core = per_core
        self._process: psutil.Process | None = None
        try:
            self._process = psutil.Process(pid)
            self._process.cpu_percent(None)  # primes the counter: the first call always returns 0.0
        except psutil.Error as exc:
            self.available = False
            self.unavailable_reason = f"process {pid} cannot be read: {exc}"
        # psutil.Process objects kept by pid across samples: cpu_percent() measures since the previous call
        # on the same object, so a fresh object per sample would always read 0.0.
        self._children: dict[int, psutil.Process] = {}
        self._queued: dict[int, tuple[float, float]] = {}  # pid -> (time.monotonic(), run delay s) at the last sample
        self._helpers: dict[int, psutil.Process] = {}  # descendants left out (HELPERS), by pid: read once
        self._started = 0
        self._private_due = 0.0  # time.monotonic() from which the next `workers.private_bytes` pass may run
        # Our own CPU-times baseline rather than psutil.cpu_percent(), whose baseline is module-global:
        # any other caller in the process (a progress bar, a profiler) would shorten our interval.
        self._cpu_times: list[Any] = list(psutil.cpu_times(percpu=True))
        self._core_keys = [f"cpu{i}.percent" for i in range(len(self._cpu_times))]

    def sample(self) -> dict[str, float]:
        if self._process is None:
            return {}
        out: dict[str, float] = {}
        self._sample_cpus(out)
        memory = psutil.virtual_memory()
        out["ram.used_bytes"] = float(memory.used)
        out["ram.percent"] = float(memory.percent)
        try:
            with self._process.oneshot():  # one read of /proc/<pid>/stat for both values
                out["proc.cpu_percent"] = float(self._process.cpu_percent(None))
                out["proc.rss_bytes"] = float(self._process.memory_info().rss)
            # Scans every /proc/<pid>/stat to build the parent map: ~0.9 ms with 70 processes, ~13 µs each.
            children = self._process.children(recursive=True)
        except psutil.Error:  # the watched process exited (or is no longer readable): system metrics only
            return out
        self._sample_children(children, out)
        return out

    def _sample_cpus(self, out: dict[str, float]) -> None:
        now = list(psutil.cpu_times(percpu=True))
        before, self._cpu_times = self._cpu_times, now
        if len(now) != len(before):  # a core went on- or offline: start a new baseline
            self._core_keys = [f"cpu{i}.percent" for i in range(len(now))]
            return
        percents = [_busy_percent(old, new) for old, new in zip(before, now, strict=True)]
        if not percents:
            return
        out["cpu.percent"] = math.fsum(percents) / len(percents)
        if self.per_core:
            out.update(zip(self._core_keys, percents, strict=True))

    def _sample_children(self, children: list[psutil.Process], out: dict[str, float]) -> None:
        alive: dict[int, psutil.Process] = {}
        cpu_sum = rss_sum = rss_max = queued_sum = 0.0
        queued_known = _SCHEDSTAT
        for child in children:
            if self._is_helper(child):
                continue
            known = self._children.get(child.pid)
            # Process equality compares pid and creation time: a recycled pid gets the new, unprimed object.
            proc = known if known is not None and known == child else child
            try:
                with proc.oneshot():
                    # An exited worker not yet reaped reads as RSS 0 and has no memory map: not a worker any more
                    zombie = proc.status() == psutil.STATUS_ZOMBIE
                    cpu = float(proc.cpu_percent(None))  # 0.0 on a new child's first sample (priming)
                    rss = float(proc.memory_info().rss)
            except psutil.Error:  # exited (or became a zombie) between listing and reading
                continue
            if zombie:
                continue
            if proc is not known:  # first read of this process (a new pid, or a recycled one)
                self._started += 1
            alive[child.pid] = proc
            queued = self._queued_percent(child.pid, fresh=proc is not known)
            if queued is None:
                queued_known = False
            else:
                queued_sum += queued
            cpu_sum += cpu
            rss_sum += rss
            rss_max = max(rss_max, rss)
        self._children = alive  # forget the ones that are gone
        self._queued = {pid: q for pid, q in self._queued.items() if pid in alive}
        out["workers.count"] = float(len(alive))
        out["workers.cpu_percent"] = cpu_sum
        out["workers.rss_bytes"] = rss_sum
        out["workers.max_rss_bytes"] = rss_max
        out["workers.started"] = float(self._started)
        if queued_known:
            out["workers.queued_percent"] = queued_sum
        private = self._workers_private(alive.values()) if alive else None
        if private is not None:
            out["workers.private_bytes"] = private

    def _queued_percent(self, pid: int, fresh: bool) -> float | None:
        """Run-queue delay of worker `pid` since the previous sample, in % of that time (0.0 on its first sample,
        as its CPU figure); None when it cannot be read."""
        delay, now = _run_delay_s(pid), time.monotonic()
        if delay is None:
            return None
        before = None if fresh else self._queued.get(pid)
        self._queued[pid] = (now, delay)
        if before is None or now <= before[0]:
            return 0.0
        return max(0.0, 100.0 * (delay - before[1]) / (now - before[0]))

    def _is_helper(self, child: psutil.Process) -> bool:
        """A helper process (HELPERS), judged once per process from its command line (~20 us to read)."""
        if self._helpers.get(child.pid) == child:
            return True
        if child.pid in self._children:  # known as a worker already
            return False
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            return False
        if any(helper in command for helper in HELPERS):
            self._helpers[child.pid] = child
            return True
        return False

    def _workers_private(self, processes: Iterable[psutil.Process]) -> float | None:
        """The processes' summed private memory when a pass is due (see PRIVATE_CPU_SHARE), else None; None too
        when one that is still running cannot be read (a partial sum would read as a drop)."""
        now = time.monotonic()
        if not _SMAPS_ROLLUP or now < self._private_due:
            return None
        spent = time.thread_time()  # this thread's CPU time, the kernel's page-table walk included
        total, complete = 0.0, True
        for proc in processes:
            try:
                total += _private_bytes(proc.pid)
            except (FileNotFoundError, ProcessLookupError):  # exited (or a zombie) since it was listed
                continue
            except OSError:
                complete = False
                break
        cost = time.thread_time() - spent
        self._private_due = now + cost / (PRIVATE_CPU_SHARE * max(1, len(self._cpu_times)))
        return total if complete else None

    def close(self) -> None:
        self._children.clear()
        self._helpers.clear()


class GpuIdentity(NamedTuple):
    """What names one physical GPU the same way in torch and in NVML."""

    uuid: str | None  # lower case, without NVML's "GPU-" prefix
    pci: tuple[int, int, int] | None  # (domain, bus, device)


def _uuid(text: str) -> str:
    text = text.strip().lower()
    return text.removeprefix("gpu-")


def cuda_identity(index: int) -> GpuIdentity | None:
    """The identity of torch's `cuda:{index}`; None until the process has initialised CUDA itself (reading
    device properties must not be what does it)."""
    if not torch.cuda.is_initialized():
        return None
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    pci = tuple(getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    return GpuIdentity(None if uuid is None else _uuid(str(uuid)),
                       None if None in pci else (int(pci[0]), int(pci[1]), int(pci[2])))  # type: ignore[arg-type]


def _nvml_identity(nvml: Any, handle: Any) -> GpuIdentity:
    uuid = pci = None
    with suppress(Exception):  # an identity is optional: without it this GPU is simply never matched
        raw = nvml.nvmlDeviceGetUUID(handle)
        uuid = _uuid(raw.decode() if isinstance(raw, bytes) else str(raw))
    with suppress(Exception):
        info = nvml.nvmlDeviceGetPciInfo(handle)
        pci = (int(info.domain), int(info.bus), int(info.device))
    return GpuIdentity(uuid, pci)


class NvmlSource:
    """Every GPU on the host through NVML (package nvidia-ml-py), without shelling out to nvidia-smi.

    Metrics per GPU i: `gpu{i}.util` (% of the last 1/6-1 s in which any kernel ran: a busy-or-idle
    signal, not a measure of how much of the GPU a kernel uses), `gpu{i}.mem_used_bytes`,
    `gpu{i}.mem_total_bytes`, `gpu{i}.temp_c`, `gpu{i}.power_w`. A query a GPU does not support (power on
    some boards) is left out. Each reading is a library call into the driver, where GPUtil started an
    `nvidia-smi` process per reading (tens of ms or more of process start and driver init each time).

    `identities` (UUID, PCI location) of each GPU, read once at start, tie NVML's indices to torch's:
    `index_of(cuda_identity(i))` is the `gpu{j}` of torch's `cuda:{i}`.

    A GPU NVML cannot open (NVML_ERROR_NO_PERMISSION for one a container hides, NVML_ERROR_GPU_IS_LOST) is skipped,
    logged once and listed in `skipped`; the others keep their NVML index and identity.
    """

    def __init__(self) -> None:
        self.name = "nvml"
        self.available = False
        self.unavailable_reason: str | None = None
        self._nvml: Any = None
        self._handles: list[Any] = []
        self.identities: list[GpuIdentity] = []  # by NVML index; kept after close()
        self.skipped: dict[int, str] = {}  # NVML index -> why its handle could not be taken
        self._keys: list[tuple[str, str, str, str, str]] = []
        self._errors: type[BaseException] = Exception
        try:
            import pynvml
        except ImportError as exc:
            self.unavailable_reason = f"pynvml cannot be imported ({exc}); install it with: pip install nvidia-ml-py"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound and friends: no NVIDIA driver here
            self.unavailable_reason = f"nvmlInit failed ({type(exc).__name__}: {exc}); no NVIDIA driver?"
            return
        # Only NVML's own errors mean "not readable"; anything else is a bug the Monitor should record.
        errors = getattr(pynvml, "NVMLError", Exception)
        try:
            count = pynvml.nvmlDeviceGetCount()
            handles = {i: self._handle(pynvml, i, errors) for i in range(count)}
        except Exception as exc:
            self.unavailable_reason = f"NVML could not list the GPUs ({type(exc).__name__}: {exc})"
            self._shutdown(pynvml)
            return
        opened = {i: handle for i, handle in handles.items() if handle is not None}
        if not opened:
            self.unavailable_reason = ("NVML is installed but sees no GPU" if not count else
                                       f"NVML sees {count} GPU(s) but could open none: "
                                       + "; ".join(f"GPU {i}: {why}" for i, why in self.skipped.items()))
            self._shutdown(pynvml)
            return
        self._nvml = pynvml
        self._handles = list(opened.values())
        # by NVML index, a skipped GPU's empty: it matches no torch GPU, and the others keep their index
        self.identities = [_nvml_identity(pynvml, opened[i]) if i in opened else GpuIdentity(None, None)
                           for i in range(count)]
        self._errors = errors
        self._keys = [(f"gpu{i}.util", f"gpu{i}.mem_used_bytes", f"gpu{i}.mem_total_bytes", f"gpu{i}.temp_c",
                       f"gpu{i}.power_w") for i in opened]
        self.available = True

    def _handle(self, nvml: Any, index: int, errors: type[BaseException]) -> Any:
        """GPU `index`'s handle, or None (logged, in `skipped`) when NVML cannot open that one GPU."""
        try:
            return nvml.nvmlDeviceGetHandleByIndex(index)
        except errors as exc:
            self.skipped[index] = f"{type(exc).__name__}: {exc}"
            log.warning("NVML: GPU %d skipped: nvmlDeviceGetHandleByIndex(%d) failed (%s); the other GPUs are still "
                        "read", index, index, self.skipped[index])
            return None

    def sample(self) -> dict[str, float]:
        nvml = self._nvml
        if nvml is None:
            return {}
        out: dict[str, float] = {}
        for handle, (util, used, total, temp, power) in zip(self._handles, self._keys, strict=True):
            with suppress(self._errors):
                out[util] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            with suppress(self._errors):
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                out[used] = float(memory.used)
                out[total] = float(memory.total)
            with suppress(self._errors):
                out[temp] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
            with suppress(self._errors):
                out[power] = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # NVML reports milliwatts
        return out

    def index_of(self, identity: GpuIdentity) -> int | None:
        """NVML's index of the GPU with this identity (UUID first, then PCI location); the only GPU when NVML
        sees one; None when none matches: no figure is better than another GPU's."""
        for field in ("uuid", "pci"):
            wanted = getattr(identity, field)
            matches = [i for i, known in enumerate(self.identities) if wanted is not None
                       and getattr(known, field) == wanted]
            if len(matches) == 1:
                return matches[0]
        return 0 if len(self.identities) == 1 else None

    def close(self) -> None:
        if self._nvml is not None:
            self._shutdown(self._nvml)
            self._nvml = None
            self._handles = []
            self.available = False
            self.unavailable_reason = "closed"

    @staticmethod
    def _shutdown(nvml: Any) -> None:
        with suppress(Exception):  # nothing useful to do if the driver refuses at exit
            nvml.nvmlShutdown()


class TorchCudaSource:
    """This process's CUDA caching-allocator figures per visible device, from `torch.cuda`.

    Metrics per device i: `cuda{i}.allocated_bytes` (held by tensors), `cuda{i}.reserved_bytes` (held by
    the allocator, what nvidia-smi attributes to the process minus the CUDA context's few hundred MB) and
    `cuda{i}.max_allocated_bytes` (peak since start or the last `reset_peak_memory_stats`). Empty until
    the process has initialised CUDA itself: reading earlier would report zeros, and the monitor must
    never be the one to create a CUDA context.
    """

    def __init__(self) -> None:
        self.name = "torch.cuda"
        self.available = torch.cuda.is_available()
        self.unavailable_reason: str | None = None
        self._keys: list[tuple[str, str, str]] = []
        if not self.available:
            self.unavailable_reason = "torch.cuda.is_available() is False (no CUDA device, or a CPU-only torch)"
            return
        self._keys = [(f"cuda{i}.allocated_bytes", f"cuda{i}.reserved_bytes", f"cuda{i}.max_allocated_bytes")
                      for i in range(torch.cuda.device_count())]

    def sample(self) -> dict[str, float]:
        if not self.available or not torch.cuda.is_initialized():
            return {}
        out: dict[str, float] = {}
        for i, (allocated, reserved, peak) in enumerate(self._keys):
            out[allocated] = float(torch.cuda.memory_allocated(i))
            out[reserved] = float(torch.cuda.memory_reserved(i))
            out[peak] = float(torch.cuda.max_memory_allocated(i))
        return out

    def close(self) -> None:
        pass  # holds nothing


class FakeSource:
    """For tests and examples: replays given series, one value per metric per `sample()`, repeating each
    series' last value once it is exhausted. `closed` tells whether `close()` was called."""

    def __init__(self, series: Mapping[str, Sequence[float]], name: str = "fake") -> None:
        empty = sorted(metric for metric, values in series.items() if len(values) == 0)
        if empty:
            raise ValueError(f"FakeSource needs at least one value per metric; empty: {empty}")
        self.name = name
        self.available = True
        self.unavailable_reason: str | None = None
        self.closed = False
        self.calls = 0
        self._series = {metric: [float(v) for v in values] for metric, values in series.items()}

    def sample(self) -> dict[str, float]:
        index = self.calls
        self.calls += 1
        return {metric: values[min(index, len(values) - 1)] for metric, values in self._series.items()}

    def close(self) -> None:
        self.closed = True
