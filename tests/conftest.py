"""Shared fixtures. Every test runs under `guard_globals`: a test that leaks a thread, an environment
variable, a process group or a change to torch's global settings fails."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainfast.data.synthetic import DemoSize, ensure_demo_dataset

# Set by torch itself, once per process, on the first optimizer step or compile: not a leak of ours.
TORCH_OWN_ENV_PREFIXES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_")
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
                  and not (request.node.get_closest_marker("torch_compile") and _torch_owned(t))]
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip, with the reason, on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
