"""What goes wrong in the input pipeline, said plainly.

- `LoaderError`: what `Loader` raises instead of torch's terse DataLoader errors (a worker that hangs past
  `timeout_s`, a worker killed by a signal, too many open files, shared memory full), naming the likely
  causes, the numbers it can read here and the fixes. The original exception is chained (`__cause__`).
- `fit_shared_memory`: the /dev/shm guard `make_loader` runs before any worker starts: it lowers
  `prefetch_factor` when /dev/shm is small, and refuses a configuration that cannot fit at all.

The machine is read through this module's `read_shm_bytes`, `read_open_files_limit` and `read_memory`, so tests
fake a 64 MiB /dev/shm or a 1024-file limit by monkeypatching them here.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Literal

from trainfast.envcheck.checks import (
    SHM_FIX,
    TINY_SHM_BYTES,
    UNLIMITED,
    read_open_files_limit,
    read_shm_bytes,
    shm_needed_bytes,
)
from trainfast.host import Memory, memory
from trainfast.loader.auto import LoaderPlan, batches_in_flight
from trainfast.units import format_bytes

__all__ = ["FailureKind", "LoaderError", "explain_failure", "fit_shared_memory", "read_memory",
           "read_open_files_limit", "read_shm_bytes"]

FailureKind = Literal["timeout", "out_of_memory", "shared_memory", "open_files", "worker_crashed",
                      "worker_exited"]

# The prefetch_factor the /dev/shm guard lowers to first (torch's own default), before trying 1.
SHM_SAFE_PREFETCH = 2
OPEN_FILES_FIX = ('raise the limit before starting Python (ulimit -n 65536; docker run --ulimit nofile=65536:65536; '
                  'systemd LimitNOFILE=65536), or call torch.multiprocessing.set_sharing_strategy("file_system") '
                  'at the start of the script')
WORKERS_0_HINT = "run with workers=0 to get the real error and traceback in the main process"

# torch's own wording (torch/utils/data/dataloader.py and the C SIGCHLD handler, torch 2.4-2.13)
_TIMEOUT = re.compile(r"DataLoader timed out after (\d+(?:\.\d*)?(?:[eE][+-]?\d+)?) seconds")
_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.\n]+)")
_EXITED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) exited unexpectedly(?: with exit code (-?\d+))?")
_EMFILE_TEXT = ("Too many open files", "received 0 items of ancdata")
_SHM_FULL = re.compile(r"unable to (?:write to file </torch_|allocate shared memory)"
                       r"|No space left on device.*(?:/dev/shm|</torch_)"
                       r"|(?:/dev/shm|</torch_).*No space left on device")


class LoaderError(RuntimeError):
    """The input pipeline failed; the message names the likely causes, the numbers read here and the fixes.

    `kind` says which failure it was: "timeout", "out_of_memory", "shared_memory", "open_files",
    "worker_crashed" or "worker_exited". The exception it explains is its `__cause__`.
    """

    def __init__(self, message: str, kind: FailureKind) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind

    def __reduce__(self) -> tuple[type[LoaderError], tuple[str, FailureKind]]:
        return type(self), (str(self), self.kind)


def read_memory() -> Memory:
    """RAM (total, available), None where psutil cannot tell: `host.memory`, named here so tests can fake it."""
    return memory()


# --- DataLoader failures -----------------------------------------------------------------------------------


def explain_failure(error: BaseException, *, num_workers: int, prefetch_factor: int | None,
                    timeout_s: float) -> LoaderError | None:
    """The `LoaderError` that explains `error` raised while fetching a batch, or None when it is none of the
    failures this module knows (a plain bug in the dataset stays as it is)."""
    if _is_too_many_files(error):
        return _open_files_error(error, num_workers)
    # torch's "exited unexpectedly" often has the SIGCHLD handler's "killed by signal" as its cause: read them all
    messages = [str(e) for e in _chain(error)]
    timed_out = _search(_TIMEOUT, messages)
    if timed_out is not None:
        return _timeout_error(timeout_s if timeout_s > 0 else float(timed_out.group(1)), num_workers)
    killed = _search(_KILLED, messages)
    if killed is not None:
        return _killed_error(int(killed.group(1)), killed.group(2).strip(), num_workers, prefetch_factor)
    exited = _search(_EXITED, messages)
    if exited is not None:
        return _exited_error(exited.group(1).strip(), exited.group(2), num_workers, prefetch_factor)
    if _search(_SHM_FULL, messages) is not None:
        return LoaderError(f"a DataLoader worker could not write a batch into shared memory: /dev/shm is full. "
                           f"{_shm_numbers(num_workers, prefetch_factor)} Fixes: {SHM_FIX}.", "shared_memory")
    return None


def _search(pattern: re.Pattern[str], messages: list[str]) -> re.Match[str] | None:
    for message in messages:
        found = pattern.search(message)
        if found is not None:
            return found
    return None


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(seen) < 8:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_too_many_files(error: BaseException) -> bool:
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return True
        # a worker's OSError comes back re-raised from its formatted traceback: the errno is only in the text
        if any(text in str(e) for text in _EMFILE_TEXT):
            return True
    return False


def _in_flight(num_workers: int, prefetch_factor: int | None) -> str:
    if num_workers == 0:
        return "num_workers=0"
    pf = 2 if prefetch_factor is None else prefetch_factor
    return f"num_workers={num_workers} x prefetch_factor={pf} = {batches_in_flight(num_workers, pf)} batches in flight"


def _shm_free() -> str:
    shm = read_shm_bytes()
    return "unknown (not readable here)" if shm is None else format_bytes(shm)


def _shm_numbers(num_workers: int, prefetch_factor: int | None) -> str:
    return (f"Workers hand every batch to the training process through /dev/shm, which has {_shm_free()} free now "
            f"(Docker's default is 64 MiB); {_in_flight(num_workers, prefetch_factor)}.")


def _memory_numbers() -> str:
    total, available = read_memory()
    if available is None or total is None:
        return "memory available now: unknown"
    return f"{format_bytes(available)} of {format_bytes(total)} memory available now"


def _open_files_error(error: BaseException, num_workers: int) -> LoaderError:
    limit = read_open_files_limit()
    shown = "unknown" if limit is None else "unlimited" if limit >= UNLIMITED else str(limit)
    # ENFILE: the whole machine's table is full, not this process's share
    system = any((isinstance(e, OSError) and e.errno == errno.ENFILE) or "open files in system" in str(e)
                 for e in _chain(error))
    scope = ("the whole system ran out of file handles (ENFILE: sysctl fs.file-max), this process's limit"
             if system else "this process hit its open-files limit (EMFILE): the limit")
    if num_workers > 0:
        who = (f"With num_workers={num_workers}, torch's default 'file_descriptor' sharing strategy keeps one "
               "descriptor open per tensor in flight between the workers and the training process, on top of "
               "the files the dataset itself opens.")
    else:
        who = ("With num_workers=0 no tensors are shared between processes, so the dataset or the training code "
               "opened these files and kept them open; once workers are used, each tensor in flight holds one "
               "more.")
    return LoaderError(f"too many open files while loading a batch: {scope} (ulimit -n) is {shown}. {who} "
                       f"Fixes: {OPEN_FILES_FIX}; and close what the dataset opens (with open(...) as f:).",
                       "open_files")


def _timeout_error(timeout_s: float, num_workers: int) -> LoaderError:
    return LoaderError(
        f"DataLoader timed out: the next batch did not arrive within timeout_s={timeout_s:g} s from "
        f"num_workers={num_workers} worker(s), so a worker is stuck or far slower than that. Likely causes: a "
        "deadlock in the dataset's __getitem__ (a lock or thread pool held when the workers forked); a database "
        "or file handle (sqlite3, lmdb, h5py, an open file) opened before the workers forked and now shared by "
        "all of them; a stalled network file system (NFS, SMB, a FUSE or S3 mount) under the data; a worker "
        "stuck inside a C library (OpenCV or OpenMP threads after fork, a decoder). Fixes: open handles lazily "
        "in each worker (on first use in __getitem__, or in worker_init_fn) and keep only the path on the "
        "dataset; raise timeout_s if batches are legitimately this slow (timeout_s=0 waits forever; the first "
        "batch also waits for the workers to start, seconds with multiprocessing_context='spawn'); try "
        f"workers=0 to see where __getitem__ blocks and the real traceback (py-spy dump --pid <worker pid> shows "
        "a live worker's stack).", "timeout")


_SPAWN_HINT = "or multiprocessing_context='spawn' if a library is not fork-safe"


def _killed_error(pid: int, signal_name: str, num_workers: int, prefetch_factor: int | None) -> LoaderError:
    head = f"DataLoader worker (pid {pid}) was killed by signal {signal_name!r}"
    if signal_name == "Killed":
        return LoaderError(
            f"{head} (SIGKILL), almost always the kernel's out-of-memory (OOM) killer: this machine or container "
            f"ran out of memory ({_memory_numbers()}; /dev/shm, whose contents count as memory too, has "
            f"{_shm_free()} free). Every worker is a process with its own copy of the dataset object and its "
            f"batches ({_in_flight(num_workers, prefetch_factor)}). Confirm with "
            "`dmesg | grep -i 'killed process'` (Docker, Kubernetes: the container shows OOMKilled). Fixes: fewer "
            "workers, a lower prefetch_factor or batch_size, keep per-sample lists in numpy arrays rather than "
            "Python lists or dicts (workers copy every object whose reference count they touch, pytorch#13246), "
            "or a higher memory limit.", "out_of_memory")
    if signal_name == "Bus error":
        return LoaderError(
            f"{head} (SIGBUS): shared memory (/dev/shm) ran out. {_shm_numbers(num_workers, prefetch_factor)} "
            f"Fixes: {SHM_FIX}.", "shared_memory")
    if signal_name == "Segmentation fault":
        return LoaderError(
            f"{head} (SIGSEGV): the worker crashed inside native code (an image decoder, OpenCV, a database "
            f"driver, a library that is not fork-safe). Fixes: {WORKERS_0_HINT} (python -X faulthandler prints "
            f"the Python stack of a crash), {_SPAWN_HINT}.", "worker_crashed")
    if signal_name == "Aborted":
        return LoaderError(
            f"{head} (SIGABRT): a C or C++ library in the worker called abort() (a failed assertion, an uncaught "
            "C++ exception, or a library such as OpenMP, MKL or CUDA refusing to run after fork); its message, if "
            f"any, is in the worker's stderr above. Fixes: {WORKERS_0_HINT}, {_SPAWN_HINT}.", "worker_crashed")
    return LoaderError(
        f"{head}: something outside the loader stopped it (a job scheduler, preemption, a watchdog, kill) or it "
        f"crashed. {_memory_numbers()}; {_in_flight(num_workers, prefetch_factor)}. Fixes: check the system log "
        f"(dmesg, the scheduler's log); {WORKERS_0_HINT}.", "worker_crashed")


def _exited_error(pids: str, code: str | None, num_workers: int, prefetch_factor: int | None) -> LoaderError:
    status = f" with exit code {code}" if code is not None else ""
    return LoaderError(
        f"DataLoader worker (pid(s) {pids}) exited unexpectedly{status}, without reporting a Python error. Likely "
        "causes: the kernel's out-of-memory killer (`dmesg | grep -i 'killed process'`; "
        f"{_memory_numbers()}, {_in_flight(num_workers, prefetch_factor)}), a crash in native code, or "
        f"sys.exit()/os._exit() in the dataset. Fixes: {WORKERS_0_HINT}; fewer workers or a lower prefetch_factor "
        "if memory is short.", "worker_exited")


# --- the /dev/shm guard ------------------------------------------------------------------------------------


def fit_shared_memory(plan: LoaderPlan, shm_bytes: int | None, batch_bytes: int | None) -> tuple[LoaderPlan, str]:
    """The plan adjusted to the free /dev/shm, and a warning to log ("" when there is nothing to say).

    With workers, below `TINY_SHM_BYTES` free (Docker's default is 64 MiB) or below what
    workers x prefetch_factor batches of `batch_bytes` need (`shm_needed_bytes`), prefetch_factor is lowered to
    2, then to 1 while the batches still do not fit. Raises `LoaderError` when even prefetch_factor=1 does not
    fit: the workers would die with 'Bus error' mid-epoch. Never changes torch's global sharing strategy.
    """
    workers, prefetch = plan.num_workers, plan.prefetch_factor
    if workers == 0 or prefetch is None or shm_bytes is None:
        return plan, ""

    def need(pf: int) -> int:
        return shm_needed_bytes(workers, pf, batch_bytes) if batch_bytes else 0

    small = shm_bytes < TINY_SHM_BYTES
    if not small and need(prefetch) <= shm_bytes:
        return plan, ""
    free = format_bytes(shm_bytes)
    sizing = "" if not batch_bytes else f", {format_bytes(batch_bytes)} per batch"
    if batch_bytes and need(1) > shm_bytes:
        fit = shm_bytes // (2 * batch_bytes)
        fewer = f"workers={fit} (at most {fit} fit at prefetch_factor=1), " if 0 < fit < workers else ""
        raise LoaderError(
            f"/dev/shm has {free} free but num_workers={workers} need about {format_bytes(need(1))} of it even at "
            f"prefetch_factor=1 ({workers} workers x 1 x {format_bytes(batch_bytes)} per batch x 2): the workers "
            "would die with 'Bus error' mid-epoch, so no worker was started. Fixes: give the container more shared "
            "memory (docker run --shm-size=8g, or --ipc=host; Kubernetes: an emptyDir with medium: Memory mounted "
            f"at /dev/shm); {fewer}a smaller batch_size, or workers=0 (no shared memory at all). "
            "Another option, a global setting trainfast does not change for you: "
            'torch.multiprocessing.set_sharing_strategy("file_system") at the start of the script.',
            "shared_memory")
    lowered = min(prefetch, SHM_SAFE_PREFETCH)
    if batch_bytes and need(lowered) > shm_bytes:
        lowered = 1
    why = (f"/dev/shm has {free} free" + (f" (< {format_bytes(TINY_SHM_BYTES)})" if small else "")
           + (f", need about {format_bytes(need(prefetch))} at prefetch_factor={prefetch}" if batch_bytes else ""))
    if lowered < prefetch:
        reason = (f"prefetch_factor={lowered} (lowered from {prefetch}: {why}; {workers * lowered} batches in "
                  "flight)")
        reasons = tuple(reason if r.startswith("prefetch_factor=") else r for r in plan.reasons)
        plan = replace(plan, prefetch_factor=lowered, reasons=reasons)
        action = f"prefetch_factor lowered from {prefetch} to {lowered}"
    else:
        action = f"prefetch_factor={prefetch} kept"
    docker = "; Docker's default is 64 MiB" if small else ""
    warning = (f"{why}{sizing}{docker}: DataLoader workers pass every batch through it and die "
               f"with 'Bus error' when it fills. {action}: {workers} worker(s) x {plan.prefetch_factor} = "
               f"{workers * (plan.prefetch_factor or 0)} batches in flight. Fix: {SHM_FIX}")
    return plan, warning
