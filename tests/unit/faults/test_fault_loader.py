"""DataLoader failures become a `LoaderError` that names the causes and the fixes: a worker that hangs past
`timeout_s`, a worker killed by SIGKILL (out of memory) / SIGBUS (/dev/shm) / SIGABRT, too many open files.

The datasets live at module level so that 'spawn' workers can import them by name; each is a `helpers.Draws`
(sample i: [i, a draw from torch's global RNG]) that fails in its own way.
"""

from __future__ import annotations

import errno
import faulthandler
import gc
import multiprocessing
import os
import pickle
import re
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from helpers import Draws
from trainfast.data.decode import CorruptImageError
from trainfast.data.images import ImageFolder
from trainfast.host import Memory
from trainfast.loader import Loader, LoaderError, faults, make_loader
from trainfast.loader.faults import explain_failure
from trainfast.trainer.signals import workers_ignore

pytestmark = pytest.mark.timeout(60)  # every test here has a hard limit; worker tests set their own

MIB = 2**20


SAMPLES = 16  # 4 batches of 4


class Hangs(Draws):
    """Blocks for `seconds` inside a worker (a deadlock, a stalled NFS read); instant in the main process."""

    def __init__(self, seconds: float) -> None:
        super().__init__(SAMPLES)
        self.seconds = seconds

    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            time.sleep(self.seconds)
        return super().__getitem__(i)


class KillsItself(Draws):
    """A worker that fetches a sample is killed by `signum` (SIGKILL: what the OOM killer sends)."""

    def __init__(self, signum: int) -> None:
        super().__init__(SAMPLES)
        self.signum = signum

    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            faulthandler.disable()  # pytest's faulthandler would dump this worker's stack into the test output
            os.kill(os.getpid(), self.signum)
            time.sleep(30)  # the signal is delivered before this ends
        return super().__getitem__(i)


class KillsOnce(Draws):
    """SIGKILLs its worker the first time any worker fetches (a marker file remembers it across processes)."""

    def __init__(self, marker: Path) -> None:
        super().__init__(SAMPLES)
        self.marker = str(marker)

    def __getitem__(self, i: int) -> torch.Tensor:
        if get_worker_info() is not None:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(30)
        return super().__getitem__(i)


class OutOfFiles(Draws):
    """Every fetch fails the way `open()` fails at the open-files limit."""

    def __getitem__(self, i: int) -> torch.Tensor:
        raise OSError(errno.EMFILE, "Too many open files")


class Buggy(Draws):
    """A plain bug in the dataset: not a loader failure, so it must stay as it is."""

    def __getitem__(self, i: int) -> torch.Tensor:
        raise KeyError(f"no sample {i}")


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the messages read from the machine: 64 MiB of /dev/shm, ulimit -n 1024, 1 of 16 GiB of RAM free."""
    monkeypatch.setattr(faults, "read_shm_bytes", lambda: 64 * MIB)
    monkeypatch.setattr(faults, "read_open_files_limit", lambda: 1024)
    monkeypatch.setattr(faults, "read_memory", lambda: Memory(total=16 * 2**30, available=2**30))


@pytest.fixture
def no_leaked_workers() -> Iterator[None]:
    """Every worker process a test starts is gone when it ends."""
    before = set(multiprocessing.active_children())
    yield
    deadline = time.monotonic() + 10
    while (left := [p for p in multiprocessing.active_children() if p not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"worker processes left running: {left}"


@pytest.fixture
def short_shutdown_grace(monkeypatch: pytest.MonkeyPatch) -> float:
    """torch's wait for a worker at shutdown, before (and again after) it sends SIGTERM: 5 s by default, cut for the
    tests whose worker hangs, so each wait ends soon. The same shutdown path, each step in its order."""
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    return 0.5


def loader_of(dataset: Dataset[Any], workers: int, **kwargs: Any) -> Loader:
    loader = make_loader(dataset, 4, workers=workers, device="cpu", shuffle=False, **kwargs)
    assert isinstance(loader, Loader)
    return loader


def first_batch_error(loader: Loader) -> LoaderError:
    try:
        with pytest.raises(LoaderError) as info:
            next(iter(loader))
    finally:
        loader.close()
    return info.value


# ----------------------------------------------------------------------------------------------- a worker hangs

@pytest.mark.timeout(60)
@pytest.mark.slow
def test_worker_hanging_past_timeout_names_the_causes_and_is_stopped(no_leaked_workers: None,
                                                                     short_shutdown_grace: float) -> None:
    loader = loader_of(Hangs(seconds=40), 1, timeout_s=1, multiprocessing_context="fork")
    start = time.monotonic()
    error = first_batch_error(loader)
    assert time.monotonic() - start < 20  # 1 s timeout + torch's grace before the stuck worker is terminated
    message = str(error)
    assert error.kind == "timeout"
    assert "did not arrive within timeout_s=1 s" in message
    for cause in ("deadlock in the dataset's __getitem__", "opened before the workers forked",
                  "stalled network file system", "stuck inside a C library"):
        assert cause in message
    for fix in ("open handles lazily in each worker", "raise timeout_s", "workers=0"):
        assert fix in message
    assert isinstance(error.__cause__, RuntimeError)
    assert "DataLoader timed out after 1 seconds" in str(error.__cause__)
    assert loader.dataloader._iterator is None


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_hung_worker_that_ignores_sigterm_is_still_stopped(no_leaked_workers: None,
                                                             short_shutdown_grace: float) -> None:
    """In `Trainer.fit` workers ignore the stop signals; torch's own shutdown ends a hung one with SIGTERM."""
    loader = loader_of(Hangs(seconds=40), 1, timeout_s=1, multiprocessing_context="fork")
    with workers_ignore((signal.SIGTERM,), loader):
        error = first_batch_error(loader)
    assert error.kind == "timeout" and loader.dataloader._iterator is None


@pytest.mark.timeout(60)
def test_slow_batches_within_the_timeout_are_fine(no_leaked_workers: None) -> None:
    loader = loader_of(Hangs(seconds=0.05), 2, timeout_s=10, multiprocessing_context="fork")
    try:
        got = list(loader)
    finally:
        loader.close()
    want = list(loader_of(Draws(SAMPLES), 0))
    assert len(got) == len(want) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------------------------- a worker killed by a signal

@pytest.mark.timeout(60)
@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.slow
def test_worker_killed_by_sigkill_names_out_of_memory(context: str, machine: None, no_leaked_workers: None) -> None:
    error = first_batch_error(loader_of(KillsItself(signal.SIGKILL), 1, multiprocessing_context=context))
    message = str(error)
    assert error.kind == "out_of_memory"
    assert re.search(r"DataLoader worker \(pid \d+\) was killed by signal 'Killed' \(SIGKILL\)", message)
    assert "out-of-memory (OOM) killer" in message
    assert "1.0 GiB of 16.0 GiB memory available now" in message and "/dev/shm" in message and "64.0 MiB" in message
    # the 64 MiB /dev/shm made make_loader lower prefetch_factor from the auto 4 to 2
    assert "num_workers=1 x prefetch_factor=2 = 2 batches in flight" in message
    assert "fewer workers" in message and "dmesg" in message
    assert isinstance(error.__cause__, RuntimeError) and "DataLoader worker" in str(error.__cause__)


@pytest.mark.timeout(60)
def test_worker_killed_by_sigbus_names_dev_shm(machine: None, no_leaked_workers: None) -> None:
    error = first_batch_error(loader_of(KillsItself(signal.SIGBUS), 1, multiprocessing_context="fork",
                                        prefetch_factor=2))
    message = str(error)
    assert error.kind == "shared_memory"
    assert "'Bus error' (SIGBUS): shared memory (/dev/shm) ran out" in message
    assert "/dev/shm, which has 64.0 MiB free now" in message
    assert "num_workers=1 x prefetch_factor=2 = 2 batches in flight" in message
    assert "--shm-size=8g" in message and "--ipc=host" in message
    assert "fewer workers or a lower prefetch_factor" in message
    assert 'set_sharing_strategy("file_system")' in message


@pytest.mark.timeout(60)
def test_worker_aborted_names_native_code(no_leaked_workers: None) -> None:
    error = first_batch_error(loader_of(KillsItself(signal.SIGABRT), 1, multiprocessing_context="fork"))
    assert error.kind == "worker_crashed"
    assert "'Aborted' (SIGABRT)" in str(error) and "abort()" in str(error) and "workers=0" in str(error)


@pytest.mark.timeout(60)
def test_iterating_again_after_a_killed_worker_starts_new_workers(tmp_path: Path, no_leaked_workers: None) -> None:
    loader = loader_of(KillsOnce(tmp_path / "killed"), 2, multiprocessing_context="fork")
    assert loader.plan.persistent_workers
    try:
        with pytest.raises(LoaderError, match="was killed by signal 'Killed'"):
            list(loader)
        assert loader.dataloader._iterator is None  # the broken persistent workers were dropped
        loader.set_epoch(0)
        got = list(loader)
    finally:
        loader.close()
    assert len(got) == 4
    assert torch.cat(got)[:, 0].tolist() == [float(i) for i in range(16)]


# ------------------------------------------------------------------------------------------ too many open files

def _assert_open_files(error: LoaderError, limit: str) -> None:
    message = str(error)
    assert error.kind == "open_files"
    assert f"(ulimit -n) is {limit}" in message
    assert "ulimit -n 65536" in message
    assert 'torch.multiprocessing.set_sharing_strategy("file_system")' in message


@pytest.mark.timeout(30)
def test_emfile_in_the_main_process_names_the_limit_and_both_fixes(machine: None) -> None:
    error = first_batch_error(loader_of(OutOfFiles(), 0))
    _assert_open_files(error, "1024")
    assert "num_workers=0" in str(error)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.EMFILE


@pytest.mark.timeout(60)
def test_emfile_in_a_worker_names_the_limit_and_both_fixes(machine: None, no_leaked_workers: None) -> None:
    error = first_batch_error(loader_of(OutOfFiles(), 1, multiprocessing_context="fork"))
    _assert_open_files(error, "1024")
    assert "num_workers=1" in str(error) and "'file_descriptor' sharing strategy" in str(error)
    assert "Caught OSError in DataLoader worker process 0" in str(error.__cause__)


@pytest.mark.timeout(60)
def test_a_real_emfile_while_reading_images_is_a_loader_error_not_a_bad_image(tiny_images: Path) -> None:
    dataset = ImageFolder(tiny_images / "val", image_size=16, on_bad_sample="skip", max_bad_fraction=1.0)
    loader = loader_of(dataset, 0)
    held: list[int] = []
    # Files left open by earlier tests' garbage would close when a collection runs mid-read and lend the read a
    # descriptor: collect them first.
    gc.collect()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = max(fd for fd in map(int, os.listdir("/proc/self/fd"))) + 8 if os.path.isdir("/proc/self/fd") else 256
    if soft != resource.RLIM_INFINITY and soft <= low:
        pytest.skip(f"the open-files limit is already {soft}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        while True:  # use up every descriptor below the limit
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        with pytest.raises(LoaderError) as info:
            next(iter(loader))
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _assert_open_files(info.value, str(low))
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EMFILE
    assert dataset.bad_samples == 0  # out of descriptors is not a corrupt image: nothing was skipped


# ------------------------------------------------------------------------------------- what is left as it was

@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_bug_in_the_dataset_is_not_translated(workers: int, no_leaked_workers: None) -> None:
    loader = loader_of(Buggy(), workers, multiprocessing_context="fork" if workers else None)
    try:
        with pytest.raises(KeyError, match="no sample 0"):
            next(iter(loader))
    finally:
        loader.close()


@pytest.mark.timeout(30)
def test_a_corrupt_image_stays_a_corrupt_image_error(tmp_path: Path, tiny_images: Path) -> None:
    root = tmp_path / "one" / "a"
    root.mkdir(parents=True)
    (root / "broken.jpg").write_bytes(b"not a jpeg")
    loader = loader_of(ImageFolder(tmp_path / "one"), 0)
    with pytest.raises(CorruptImageError, match=re.escape("broken.jpg")):
        next(iter(loader))


# -------------------------------------------------------------------------------- explain_failure, message by message

CAUGHT_IN_WORKER = "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"


@pytest.mark.parametrize(("error", "kind", "says"), [
    (RuntimeError("DataLoader worker (pid 12) is killed by signal: Segmentation fault. "), "worker_crashed",
     ["'Segmentation fault' (SIGSEGV)", "native code", "workers=0", "faulthandler", "spawn"]),
    (RuntimeError("DataLoader worker (pid 12) is killed by signal: Terminated. "), "worker_crashed",
     ["'Terminated'", "outside the loader", "1.0 GiB of 16.0 GiB"]),
    (RuntimeError("DataLoader worker (pid(s) 5, 6) exited unexpectedly"), "worker_exited",
     ["pid(s) 5, 6", "out-of-memory killer", "1.0 GiB of 16.0 GiB", "workers=0"]),
    (RuntimeError("DataLoader worker (pid 77) exited unexpectedly with exit code 3. Details are lost due to "
                  "multiprocessing."), "worker_exited", ["pid(s) 77", "with exit code 3", "os._exit()"]),
    (RuntimeError("received 0 items of ancdata"), "open_files", ["(ulimit -n) is 1024", "ulimit -n 65536"]),
    (RuntimeError("Too many open files. Communication with the workers is no longer possible."), "open_files",
     ["(ulimit -n) is 1024", "'file_descriptor' sharing strategy"]),
    (OSError(errno.ENFILE, "Too many open files in system"), "open_files", ["fs.file-max"]),
    (RuntimeError(CAUGHT_IN_WORKER + "RuntimeError: unable to write to file </torch_12_34_5>: No space left on "
                  "device (28)"), "shared_memory", ["/dev/shm is full", "64.0 MiB free", "--shm-size"]),
    (RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on device (28)"),
     "shared_memory", ["/dev/shm is full"]),
    (RuntimeError("DataLoader timed out after 7 seconds"), "timeout", ["timeout_s=7 s"]),
])
def test_explain_failure(machine: None, error: BaseException, kind: str, says: list[str]) -> None:
    explained = explain_failure(error, num_workers=2, prefetch_factor=2, timeout_s=0)
    assert explained is not None and explained.kind == kind
    for text in says:
        assert text in str(explained)


def test_explain_failure_reads_the_signal_from_the_cause() -> None:
    """torch re-raises the SIGCHLD handler's "killed by signal" as "exited unexpectedly": the signal is in
    the cause."""
    try:
        try:
            raise RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed. ")
        except RuntimeError as e:
            raise RuntimeError("DataLoader worker (pid(s) 9) exited unexpectedly") from e
    except RuntimeError as outer:
        explained = explain_failure(outer, num_workers=1, prefetch_factor=2, timeout_s=0)
    assert explained is not None and explained.kind == "out_of_memory"


@pytest.mark.parametrize("error", [KeyError("x"), ValueError("bad shape"), RuntimeError("CUDA error"),
                                   OSError(errno.ENOENT, "No such file or directory")])
def test_explain_failure_leaves_other_errors_alone(error: BaseException) -> None:
    assert explain_failure(error, num_workers=2, prefetch_factor=2, timeout_s=0) is None


def test_loader_error_is_a_runtime_error_that_pickles_with_its_kind() -> None:
    error = LoaderError("the next batch did not arrive", "timeout")
    assert isinstance(error, RuntimeError)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.kind) == (LoaderError, "the next batch did not arrive", "timeout")


def test_timeout_without_workers_is_ignored_and_says_so() -> None:
    loader = loader_of(Draws(SAMPLES), 0, timeout_s=2)
    assert "timeout_s=2 ignored: it bounds the wait for worker processes and there are none" in loader.plan.describe()
    assert len(list(loader)) == 4


@pytest.mark.parametrize("timeout_s", [-1, float("nan"), float("inf"), "5", True])
def test_invalid_timeout_is_refused(timeout_s: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"timeout_s={timeout_s!r} is not valid; use a number of "
                                                   "seconds >= 0 (0 waits for each batch forever)")):
        make_loader(Draws(SAMPLES), 4, workers=1, device="cpu", timeout_s=timeout_s)
