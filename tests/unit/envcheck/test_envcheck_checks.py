"""The pure checks (table-driven: status, the measured numbers echoed, the fix) and the readers against fakes."""

from __future__ import annotations

import os
import resource
import sys
import types
from typing import Any

import pytest

from trainfast.envcheck import checks
from trainfast.envcheck.checks import (
    MIB,
    UNLIMITED,
    Check,
    cpu_check,
    cuda_alloc_conf_check,
    cuda_versions_check,
    nvml_check,
    open_files_check,
    read_cuda_alloc_conf,
    read_driver_version,
    read_open_files_limit,
    read_shm_bytes,
    read_tf32_settings,
    shm_check,
    shm_needed_bytes,
    tf32_check,
    versions_check,
)

GIB = 2**30


def test_check_to_json_and_status_validation() -> None:
    c = Check("shm", "warn", "small", "grow it")
    assert c.to_json() == {"name": "shm", "status": "warn", "detail": "small", "fix": "grow it"}
    assert Check("x", "ok", "fine").fix == ""
    with pytest.raises(ValueError, match=r"'bad'.*ok, warn, fail, info"):
        Check("x", "bad", "?")  # type: ignore[arg-type]


@pytest.mark.parametrize(("workers", "affinity", "quota", "status", "in_detail", "in_fix"), [
    (None, 8, None, "info", ["8 usable CPUs", "affinity 8", "no cgroup CPU quota"], []),
    (4, 8, None, "ok", ["num_workers=4", "8 usable CPUs"], []),
    (8, 8, None, "ok", ["num_workers=8"], []),
    (9, 8, None, "warn", ["num_workers=9", "8 usable CPUs", "slower"], ["num_workers <= 7", "'auto'"]),
    # the cgroup quota caps the affinity: 64 cores visible, 2 CPUs of quota
    (8, 64, 2.0, "warn", ["num_workers=8", "2 usable CPUs", "affinity 64", "cgroup quota 2 CPUs"],
     ["num_workers <= 1"]),
    (2, 64, 1.5, "ok", ["2 usable CPUs", "cgroup quota 1.5 CPUs"], []),
    (2, 1, None, "warn", ["num_workers=2", "1 usable CPUs"], ["num_workers <= 0"]),
])
def test_cpu_check(workers: int | None, affinity: int, quota: float | None, status: str, in_detail: list[str],
                   in_fix: list[str]) -> None:
    c = cpu_check(workers, affinity, quota)
    assert (c.name, c.status) == ("cpu", status)
    for text in in_detail:
        assert text in c.detail
    for text in in_fix:
        assert text in c.fix
    assert bool(c.fix) == (status == "warn")


def test_shm_needed_is_workers_x_prefetch_x_batch_x_2() -> None:
    assert shm_needed_bytes(4, 2, 10 * MIB) == 160 * MIB
    assert shm_needed_bytes(4, None, 10 * MIB) == 160 * MIB  # torch's default prefetch_factor is 2
    assert shm_needed_bytes(2, 8, MIB) == 32 * MIB


@pytest.mark.parametrize(("shm", "workers", "prefetch", "batch", "status", "in_detail"), [
    (None, 4, 2, MIB, "info", ["unknown"]),
    (64 * MIB, 0, None, 100 * MIB, "ok", ["64.0 MiB", "num_workers=0"]),
    # need = 4 x 2 x 100 MiB x 2 = 1.6 GiB
    (GIB, 4, 2, 100 * MIB, "fail", ["1.0 GiB free", "4 workers x prefetch_factor 2 x 100.0 MiB", "1.6 GiB",
                                    "bus error"]),
    (2 * GIB, 4, 2, 100 * MIB, "warn", ["2.0 GiB free", "less than twice", "1.6 GiB"]),
    (8 * GIB, 4, 2, 100 * MIB, "ok", ["8.0 GiB free", "1.6 GiB"]),
    (8 * GIB, 4, None, 100 * MIB, "ok", ["prefetch_factor 2"]),
    (64 * MIB, 2, 2, None, "warn", ["64.0 MiB", "< 256.0 MiB", "Docker's default is 64 MiB", "num_workers=2"]),
    (64 * MIB, None, None, None, "warn", ["64.0 MiB", "DataLoader workers"]),
    (64 * MIB, 1, 2, MIB, "warn", ["64.0 MiB", "Docker"]),  # room for the batches, but tiny
    (4 * GIB, None, None, None, "ok", ["4.0 GiB free"]),
    (4 * GIB, 2, 2, None, "ok", ["4.0 GiB free"]),
])
def test_shm_check(shm: int | None, workers: int | None, prefetch: int | None, batch: int | None, status: str,
                   in_detail: list[str]) -> None:
    c = shm_check(shm, workers, prefetch, batch)
    assert (c.name, c.status) == ("shm", status)
    for text in in_detail:
        assert text in c.detail
    if status in ("warn", "fail"):
        for fix in ("--shm-size=8g", "--ipc=host", "fewer workers", "prefetch_factor",
                    'set_sharing_strategy("file_system")'):
            assert fix in c.fix
    else:
        assert c.fix == ""


@pytest.mark.parametrize(("limit", "workers", "status", "in_detail"), [
    (None, 4, "info", ["unknown"]),
    (1024, 4, "warn", ["1024", "< 4096", "num_workers=4", "Too many open files", "EMFILE"]),
    (1024, None, "warn", ["1024", "DataLoader workers"]),
    (1024, 0, "ok", ["1024", "num_workers=0"]),
    (4096, 4, "ok", ["4096"]),
    (UNLIMITED, 4, "ok", ["unlimited"]),
])
def test_open_files_check(limit: int | None, workers: int | None, status: str, in_detail: list[str]) -> None:
    c = open_files_check(limit, workers)
    assert (c.name, c.status) == ("open_files", status)
    for text in in_detail:
        assert text in c.detail
    if status == "warn":
        assert "ulimit -n 65536" in c.fix and 'set_sharing_strategy("file_system")' in c.fix


@pytest.mark.parametrize(("value", "cuda", "status", "suggests"), [
    (None, False, "info", False),
    ("expandable_segments:True", False, "info", False),
    (None, True, "info", True),
    ("max_split_size_mb:128", True, "info", True),
    ("expandable_segments:False", True, "info", True),
    ("expandable_segments:True", True, "ok", False),
    ("max_split_size_mb:128, expandable_segments:true", True, "ok", False),
])
def test_cuda_alloc_conf_check(value: str | None, cuda: bool, status: str, suggests: bool) -> None:
    c = cuda_alloc_conf_check(value, cuda)
    assert (c.name, c.status) == ("cuda_alloc_conf", status)
    assert ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in c.fix) == suggests
    if value:
        assert value in c.detail
    if suggests:
        assert "fragment" in c.detail


@pytest.mark.parametrize(("cuda", "cap", "precision", "cudnn", "status", "in_detail", "in_fix"), [
    (False, None, "highest", True, "info", ["'highest'", "needs a CUDA GPU"], []),
    (True, (7, 5), "highest", True, "info", ["sm_75", "no TF32"], []),
    (True, (8, 0), "highest", True, "warn", ["'highest'", "sm_80", "~8x"],
     ['torch.set_float32_matmul_precision("high")', 'precision="auto"']),
    (True, (9, 0), "highest", False, "warn", ["sm_90", "cuDNN TF32 is off"],
     ['set_float32_matmul_precision("high")', "allow_tf32 = True"]),
    (True, (8, 6), "high", True, "ok", ["sm_86", "'high'"], []),
    (True, (8, 9), "medium", True, "ok", ["sm_89"], []),
    (True, (8, 0), "high", False, "warn", ["cuDNN TF32 is off"], ["allow_tf32 = True"]),
])
def test_tf32_check(cuda: bool, cap: tuple[int, int] | None, precision: str, cudnn: bool, status: str,
                    in_detail: list[str], in_fix: list[str]) -> None:
    c = tf32_check(cuda, cap, precision, cudnn)
    assert (c.name, c.status) == ("tf32", status)
    for text in in_detail:
        assert text in c.detail
    for text in in_fix:
        assert text in c.fix
    if not in_fix:
        assert c.fix == ""


@pytest.mark.parametrize(("cuda", "cudnn", "driver", "available", "status", "in_detail"), [
    (None, None, None, False, "info", ["CPU-only torch build", "torch 2.9.0"]),
    (None, None, "550.54", False, "info", ["CPU-only", "driver 550.54"]),
    ("12.8", 91002, "570.1", True, "ok", ["CUDA 12.8", "cuDNN 91002", "driver 570.1"]),
    ("12.8", 91002, None, False, "info", ["CUDA 12.8", "driver n/a", "no NVIDIA driver"]),
    ("12.8", 91002, "470.1", False, "warn", ["driver 470.1", "not available"]),
])
def test_versions_check(cuda: str | None, cudnn: int | None, driver: str | None, available: bool, status: str,
                        in_detail: list[str]) -> None:
    c = versions_check("2.9.0", cuda, cudnn, driver, available)
    assert (c.name, c.status) == ("cuda_versions", status)
    for text in in_detail:
        assert text in c.detail
    if status == "warn":
        assert "nvidia-smi" in c.fix and "12.8" in c.fix
    if driver and cuda is None:
        assert "CUDA build of torch" in c.fix


def test_cuda_versions_and_nvml_on_this_cpu_only_machine() -> None:
    import torch

    if torch.cuda.is_available():  # pragma: no cover - the GPU machine
        pytest.skip("describes a CPU-only machine")
    c = cuda_versions_check()
    assert c.status in ("info", "warn")
    if torch.version.cuda is None:
        assert c.detail.startswith("CPU-only torch build")
    n = nvml_check()
    assert n.name == "nvml" and n.status in ("ok", "info")


class _FakeNvml(types.ModuleType):
    def __init__(self, fail_init: bool = False, fail_query: bool = False) -> None:
        super().__init__("pynvml")
        self.fail_init, self.fail_query = fail_init, fail_query
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> bytes:
        if self.fail_query:
            raise RuntimeError("GPU is lost")
        return b"550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return 2


def test_nvml_check_and_driver_version_with_a_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    c = nvml_check()
    assert c.status == "ok" and "550.54.15" in c.detail and "2 GPU(s)" in c.detail
    assert read_driver_version() == "550.54.15"
    assert fake.calls == ["init", "shutdown", "init", "shutdown"]

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(fail_init=True))
    assert nvml_check() == Check("nvml", "info", "n/a (no NVIDIA driver)")
    assert read_driver_version() is None

    broken = _FakeNvml(fail_query=True)
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    c = nvml_check()
    assert c.status == "warn" and "GPU is lost" in c.detail
    assert read_driver_version() is None
    assert broken.calls.count("shutdown") == 2  # shut down even when the query failed


def test_nvml_check_never_raises_when_pynvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert nvml_check().status == "info"
    assert read_driver_version() is None


def test_read_shm_bytes_is_the_free_space(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def statvfs(path: str) -> Any:
        seen.append(path)
        return types.SimpleNamespace(f_bavail=1000, f_frsize=4096, f_blocks=5000)

    monkeypatch.setattr(os, "statvfs", statvfs)
    assert read_shm_bytes() == 4096 * 1000
    assert read_shm_bytes("/other") == 4096 * 1000
    assert seen == ["/dev/shm", "/other"]


def test_read_shm_bytes_none_when_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(path: str) -> Any:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "statvfs", missing)
    assert read_shm_bytes() is None
    monkeypatch.delattr(os, "statvfs")  # Windows
    assert read_shm_bytes() is None


def test_read_shm_bytes_on_this_machine() -> None:
    value = read_shm_bytes()
    assert value is None or value >= 0
    assert read_shm_bytes("/no/such/dir") is None


@pytest.mark.parametrize(("soft", "expected"), [(1024, 1024), (65536, 65536), (resource.RLIM_INFINITY, UNLIMITED)])
def test_read_open_files_limit(monkeypatch: pytest.MonkeyPatch, soft: int, expected: int) -> None:
    asked: list[int] = []

    def getrlimit(which: int) -> tuple[int, int]:
        asked.append(which)
        return soft, resource.RLIM_INFINITY

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    assert read_open_files_limit() == expected
    assert asked == [resource.RLIMIT_NOFILE]


def test_read_open_files_limit_none_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(which: int) -> tuple[int, int]:
        raise OSError("not supported")

    monkeypatch.setattr(resource, "getrlimit", fails)
    assert read_open_files_limit() is None


def test_read_cuda_alloc_conf_prefers_the_new_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert read_cuda_alloc_conf() is None
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert read_cuda_alloc_conf() == "max_split_size_mb:64"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert read_cuda_alloc_conf() == "expandable_segments:True"


def test_read_tf32_settings_reads_without_changing_anything() -> None:
    import torch

    before = torch.get_float32_matmul_precision()
    precision, cudnn_tf32 = read_tf32_settings()
    assert precision == before and isinstance(cudnn_tf32, bool)


def test_read_tf32_settings_when_the_legacy_getter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def mixed_apis() -> str:
        raise RuntimeError("you have used mix of the legacy and new APIs")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", mixed_apis)
    # a stand-in for torch's settings object: setting the real one would change torch's globals
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(fp32_precision="tf32"))
    assert read_tf32_settings()[0] == "high"
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(fp32_precision="ieee"))
    assert read_tf32_settings()[0] == "highest"


def test_format_bytes() -> None:
    assert checks.format_bytes(None) == "unknown"
    assert checks.format_bytes(512) == "512 B"
    assert checks.format_bytes(64 * MIB) == "64.0 MiB"
    assert checks.format_bytes(8 * GIB) == "8.0 GiB"
