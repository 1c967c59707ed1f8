"""Shared fixtures. Every test runs under `guard_globals`: a test that leaks a thread, an environment
variable, a process group or a change to torch's global settings fails."""

from __future__ import annotations

import errno
import gc
import io
import logging
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import torch

from helpers import ZIP_WRITER_FULL
from remote_servers import RemoteServer
from trainfast import atomic
from trainfast.data.synthetic import DemoSize, ensure_demo_dataset

# Set by torch itself, once per process, on the first optimizer step or compile: not a leak of ours.
TORCH_OWN_ENV_PREFIXES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_")
# fsspec's event loop thread, one per process for its lifetime (remote data's requests run on it), and its loop's
# default executor threads (DNS lookups, botocore's file reads)
FSSPEC_IO_THREAD = "fsspecIO"
TINY = DemoSize(name="tiny", train_per_class=8, val_per_class=4)  # 10 classes: 80 train, 40 val images
# JPEGs decode with Pillow in every test process (workers too) unless a test picks simplejpeg: the auto choice
# times both libraries, and tests that spy on Pillow's draft() must not depend on which won on this machine.
os.environ.setdefault("TRAINFAST_JPEG", "pillow")


def _torch_globals() -> dict[str, object]:
    return {"threads": torch.get_num_threads(), "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "matmul_precision": torch.get_float32_matmul_precision(), "grad_enabled": torch.is_grad_enabled()}


@pytest.fixture(autouse=True)
def guard_globals(request: pytest.FixtureRequest) -> object:
    threads_before = set(threading.enumerate())
    env_before = dict(os.environ)
    torch_before = _torch_globals()
    yield
    deadline = time.monotonic() + 5.0  # loader pin-memory / rich refresh threads stop asynchronously
    while True:
        leaked = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()
                  and not (request.node.get_closest_marker("torch_compile") and _torch_owned(t))
                  and not _fsspec_owned(t)]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if leaked:
        problems.append(f"threads left running: {[t.name for t in leaked]}")
    changed = {k for k in set(os.environ) | set(env_before)
               if os.environ.get(k) != env_before.get(k) and not k.startswith(TORCH_OWN_ENV_PREFIXES)}
    if changed:
        problems.append(f"environment variables changed: {sorted(changed)}")
    if _torch_globals() != torch_before:
        problems.append(f"torch globals changed: {torch_before} -> {_torch_globals()}")
        torch.set_num_threads(int(torch_before["threads"]))  # type: ignore[call-overload]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        problems.append("a torch.distributed process group was left initialised")
    if problems:
        pytest.fail("; ".join(problems))


def _fsspec_owned(thread: threading.Thread) -> bool:
    if thread.name == FSSPEC_IO_THREAD:
        return True
    return thread.name.startswith("asyncio_") and any(t.name == FSSPEC_IO_THREAD for t in threading.enumerate())


def _torch_owned(thread: threading.Thread) -> bool:
    """torch.compile keeps process-lifetime pools (compile workers, tqdm's progress monitor); a test marked
    torch_compile may leave them."""
    target = getattr(thread, "_target", None)
    owner = getattr(target, "__module__", None) or type(thread).__module__
    return owner.startswith(("torch", "concurrent.futures", "tqdm"))


@pytest.fixture
def trainfast_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the "trainfast" logger, which may not propagate to the root logger."""
    logger = logging.getLogger("trainfast")
    caplog.set_level(logging.INFO, logger="trainfast")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def one_intra_op_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 for the test, put back after it. On 2 cores that other processes keep busy, a
    step on 2 threads waits at each op for the thread that lost its core: a small conv net's 5-25 ms step took
    0.1-0.7 s with two busy loops beside the suite, all of it "compute", and a script the doctor runs in this
    process was classified by that. Where a test checks a classification, its script's compute stays one core's
    work, which load slows but does not change in kind."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def saved_rngs() -> Iterator[None]:
    """The global RNGs (torch's CPU generator, numpy's, Python's `random`) put back as they were after the test."""
    t, n, p = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(t)
    np.random.set_state(n)
    random.setstate(p)


@pytest.fixture(scope="session")
def tiny_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-class demo dataset with 8 train and 4 val JPEGs per class (300-500 px), made once per session."""
    return ensure_demo_dataset(TINY, root=tmp_path_factory.mktemp("data") / "tiny", processes=1)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$TRAINFAST_CACHE pointed at an empty folder for the test."""
    monkeypatch.setenv("TRAINFAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def _shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def demo_cache(_shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$TRAINFAST_CACHE pointed at a folder shared by the session, so the demo dataset is generated once."""
    monkeypatch.setenv("TRAINFAST_CACHE", str(_shared_cache))
    return _shared_cache


# --- object storage on localhost (tests/remote_servers.py): real servers in child processes, one per test module
# (not per session: a child process of the test session would count as a loader worker wherever a later test reads
# this process's children, as the monitor and the doctor do)

REMOTE_RETRY_S = "2"  # TRAINFAST_REMOTE_RETRY_S in tests: a failing request gives up after ~2 s


@pytest.fixture(scope="module")
def _http_server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    with RemoteServer("http", tmp_path_factory.mktemp("http-root")) as server:
        yield server


@pytest.fixture(scope="module")
def _s3_server_process() -> Iterator[RemoteServer]:
    with RemoteServer("s3") as server:
        yield server


def _fresh(server: RemoteServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteServer]:
    monkeypatch.setenv("TRAINFAST_REMOTE_RETRY_S", REMOTE_RETRY_S)
    server.command("up")  # a test may have taken it down
    server.command("reset")
    server.command("latency 0")
    yield server
    server.command("up")


@pytest.fixture
def http_server(_http_server_process: RemoteServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteServer]:
    """A static HTTP server on localhost with Range requests, serving the files under `http_server.root` at
    `http_server.url`; no injected latency or failures at the start of the test; TRAINFAST_REMOTE_RETRY_S=2."""
    yield from _fresh(_http_server_process, monkeypatch)


@pytest.fixture
def s3_server(_s3_server_process: RemoteServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteServer]:
    """moto's S3-compatible server on localhost, reached through the environment as a real one is (fake
    credentials, AWS_ENDPOINT_URL); `s3_server.make_bucket(name)`; no injected latency or failures at the start of
    the test; TRAINFAST_REMOTE_RETRY_S=2."""
    for name, value in _s3_server_process.s3_env().items():
        monkeypatch.setenv(name, value)
    yield from _fresh(_s3_server_process, monkeypatch)


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def torch_save_full_from(call: int, error: Callable[[], BaseException] = no_space) -> Callable[..., None]:
    """A `torch.save` whose volume fills up at its `call`-th save to a file (1: the first): part of the zip is written,
    then `error()` is raised, as torch's writer does. Saves to memory pass through uncounted.

    Plain (not a fixture) so that a test's subprocess can install it too: scripts/train_full_volume.py."""
    real_save, calls = torch.save, [0]

    def save(obj: object, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, io.BufferedWriter):
            return real_save(obj, f, *args, **kwargs)
        calls[0] += 1
        if calls[0] < call:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04" + bytes(4096))
        raise error()
    return save


def atomic_writes_full_from(call: int, write: Callable[..., Path] = atomic.atomic_write) -> Callable[..., Path]:
    """`trainfast.atomic.atomic_write` on a volume that fills up at its `call`-th write (1: the first): the
    temporary file gets part of the data, then ENOSPC (and is removed, as on a real full disk)."""
    calls = [0]

    def atomic_write(path: str | Path, fill: Callable[[BinaryIO], None]) -> Path:
        calls[0] += 1
        if calls[0] < call:
            return write(path, fill)

        def partial(f: BinaryIO) -> None:
            f.write(bytes(4096))
            raise no_space()
        return write(path, partial)
    return atomic_write


@pytest.fixture(params=ZIP_WRITER_FULL, ids=["unexpected-pos", "file-write-failed"])
def zip_writer_full(request: pytest.FixtureRequest) -> str:
    """Each message torch's zip writer raises (as a RuntimeError) on a full volume: the test runs once per message."""
    return str(request.param)


class FullVolume:
    """Fills the volume up under trainfast's writes, from a given write on (1: the first)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def torch_save_from(self, call: int, error: Callable[[], BaseException] = no_space) -> None:
        """`torch.save` (every checkpoint write): see `torch_save_full_from`."""
        self.monkeypatch.setattr(torch, "save", torch_save_full_from(call, error))

    def atomic_writes_from(self, call: int, module: Any = atomic) -> None:
        """`atomic_write` as `module` calls it (`trainfast.atomic`: reports, summaries, JSON; a module that imported
        it by name, such as `trainfast.data.packing` for its shards, is patched on its own)."""
        self.monkeypatch.setattr(module, "atomic_write", atomic_writes_full_from(call, module.atomic_write))


@pytest.fixture
def full_volume(monkeypatch: pytest.MonkeyPatch) -> FullVolume:
    return FullVolume(monkeypatch)


class Tmpfs:
    """A folder on a tmpfs of its own: a real volume that fills up."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def resize(self, size: str) -> None:
        """Make room (or less): `size` as mount takes it, "16m"."""
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Tmpfs]]:
    """`mount_tmpfs("2m")`: a `Tmpfs` of that size, unmounted after the test. Skips, saying why, where this process
    may not mount one (CI runs as root)."""
    mounted: list[Path] = []

    def mount(size: str) -> Tmpfs:
        if os.geteuid() != 0:
            pytest.skip(f"mounting a tmpfs needs root (CI runs as root); this test runs as uid {os.geteuid()}")
        if shutil.which("mount") is None:
            pytest.skip("no mount command on this machine")
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:  # a container without CAP_SYS_ADMIN
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or f'mount exited {done.returncode}'}")
        mounted.append(folder)
        return Tmpfs(folder)

    try:
        yield mount
    finally:
        for folder in reversed(mounted):
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(folder)], capture_output=True)  # still busy: detach it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip, with the reason, on machines without CUDA; tests marked `stress` unless
    TRAINFAST_STRESS=1 (`make stress`)."""
    skips = {"stress": pytest.mark.skip(reason="a stress run: make stress runs it (TRAINFAST_STRESS=1)")}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    if os.environ.get("TRAINFAST_STRESS") == "1":
        del skips["stress"]
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker):
                item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What importing torch and collecting ~2300 tests left on the heap (~400k objects) is frozen out of the
    garbage collector: every collection, and every doctor run's `gc.collect()` and scan for the model, then walks
    only what the tests made since, not the session's heap (0.3 s to 0.08 s a collection; tests/unit 148 s to
    115 s on 2 cores). Nothing a test creates is frozen."""
    gc.collect()
    gc.freeze()
