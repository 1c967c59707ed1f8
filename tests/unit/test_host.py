"""host.py: the cgroup CPU quota (v1 and v2) and the usable-CPU count derived from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainfast.host import affinity_cpus, available_cpus, cgroup_cpu_limit, usable_cpus


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


V1_QUOTA, V1_PERIOD = "cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us"


@pytest.mark.parametrize(("files", "expected"), [
    # cgroup v2: "<quota> <period>" or "max <period>"
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "200000 100000"}, 2.0),
    ({"cpu.max": "50000 100000\n"}, 0.5),
    ({"cpu.max": "max 100000\n"}, None),
    # cgroup v1: quota -1 means unlimited
    ({V1_QUOTA: "150000\n", V1_PERIOD: "100000\n"}, 1.5),
    ({V1_QUOTA: "400000", V1_PERIOD: "100000"}, 4.0),
    ({V1_QUOTA: "-1\n", V1_PERIOD: "100000\n"}, None),
    ({V1_QUOTA: "100000", V1_PERIOD: "0"}, None),
    # v2 wins when both are present; "max" in v2 is final
    ({"cpu.max": "300000 100000", V1_QUOTA: "100000", V1_PERIOD: "100000"}, 3.0),
    ({"cpu.max": "max 100000", V1_QUOTA: "100000", V1_PERIOD: "100000"}, None),
    # v2 garbage falls back to v1
    ({"cpu.max": "garbage", V1_QUOTA: "200000", V1_PERIOD: "100000"}, 2.0),
    # missing or garbage files: no limit known
    ({}, None),
    ({"cpu.max": ""}, None),
    ({"cpu.max": "garbage"}, None),
    ({"cpu.max": "1 2 3"}, None),
    ({"cpu.max": "abc 100000"}, None),
    ({V1_QUOTA: "150000"}, None),
    ({V1_PERIOD: "100000"}, None),
    ({V1_QUOTA: "lots", V1_PERIOD: "100000"}, None),
    ({V1_QUOTA: "100000", V1_PERIOD: ""}, None),
], ids=lambda v: repr(v) if not isinstance(v, dict) else ",".join(f"{k}={t.strip()!r}" for k, t in v.items()) or "none")
def test_cgroup_cpu_limit(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    root = _write(tmp_path, files)
    assert cgroup_cpu_limit(root) == expected
    assert cgroup_cpu_limit(str(root)) == expected  # str or Path


def test_cgroup_cpu_limit_missing_root(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "does-not-exist") is None


def test_cgroup_cpu_limit_directory_in_place_of_file(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").mkdir()  # reading raises IsADirectoryError, an OSError
    assert cgroup_cpu_limit(tmp_path) is None


@pytest.mark.parametrize(("affinity", "limit", "expected"), [
    (8, 1.5, 2),     # a fractional quota keeps ceil(quota) cores busy
    (8, 2.0, 2),
    (8, None, 8),    # no quota: the affinity mask
    (2, 16.0, 2),    # the quota is above the mask: the mask
    (8, 0.5, 1),
    (8, 0.0, 1),     # never below 1
    (0, None, 1),
    (1, None, 1),
    (64, 63.01, 64),
])
def test_usable_cpus(affinity: int, limit: float | None, expected: int) -> None:
    assert usable_cpus(affinity, limit) == expected


def test_available_cpus_is_a_positive_count_within_affinity() -> None:
    assert 1 <= available_cpus() <= max(1, affinity_cpus())


def test_memory_names_total_and_available(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from trainfast import host

    class VM:
        total, available = 16 * 2**30, 2**30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM())
    assert host.memory() == host.Memory(total=16 * 2**30, available=2**30)

    def unsupported() -> None:
        raise RuntimeError("no /proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", unsupported)
    assert host.memory() == host.Memory(None, None)


def test_queued_s_is_per_thread_and_leaks_no_descriptor() -> None:
    import threading

    from trainfast.host import QUEUE_KNOWN, queued_s

    first = queued_s()
    assert first >= 0.0 and queued_s() >= first  # a running total
    if not QUEUE_KNOWN:
        assert first == 0.0
        return
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):  # each thread opens its own file, closed when it ends
        thread = threading.Thread(target=queued_s)
        thread.start()
        thread.join()
    assert len(os.listdir("/proc/self/fd")) <= before
