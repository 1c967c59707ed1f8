"""`preflight` on real loaders (never fetching a batch), `environment()`'s JSON contract and the bug-report block."""

from __future__ import annotations

import importlib
import json
import sqlite3
import types
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from trainfast import make_loader
from trainfast.envcheck import (
    CONTRACT_FIELDS,
    Check,
    bug_report_block,
    environment,
    estimate_batch_bytes,
    loader_settings,
    preflight,
)
from trainfast.loader.make import Loader
from trainfast.loader.memory import TensorLoader

# the module, not the function `trainfast.envcheck.environment` that shadows its name on the package
environment_module = importlib.import_module("trainfast.envcheck.environment")
checks_module = importlib.import_module("trainfast.envcheck.checks")


class Recording(Dataset[tuple[torch.Tensor, int]]):
    """Records every `__getitem__`: preflight must not fetch anything."""

    def __init__(self, n: int = 8, db: sqlite3.Connection | None = None) -> None:
        self.n, self.calls, self.db = n, 0, db

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.calls += 1
        return torch.zeros(3), i


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed machine: 2 usable CPUs, 64 MiB of /dev/shm, ulimit -n 1024."""
    monkeypatch.setattr(environment_module, "affinity_cpus", lambda: 2)
    monkeypatch.setattr(environment_module, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(checks_module, "read_shm_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(checks_module, "read_open_files_limit", lambda: 1024)


def test_torch_dataloader_with_workers(machine: None, db: sqlite3.Connection) -> None:
    dataset = Recording(db=db)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=2)
    assert loader_settings(loader) == (2, 2)
    checks = _by_name(preflight(loader, batch_bytes=10 * 2**20))
    assert list(checks) == ["cpu", "shm", "open_files", "db_handles"]
    assert checks["cpu"].status == "ok" and "num_workers=2" in checks["cpu"].detail
    # 2 workers x 2 batches x 10 MiB x 2 = 80 MiB > 64 MiB free
    assert checks["shm"].status == "fail" and "80.0 MiB" in checks["shm"].detail
    assert checks["open_files"].status == "warn" and "1024" in checks["open_files"].detail
    assert checks["db_handles"].status == "warn" and "dataset.db is a sqlite3.Connection" in checks["db_handles"].detail
    assert dataset.calls == 0
    assert loader._iterator is None  # no workers were started


def test_torch_dataloader_without_workers(machine: None) -> None:
    dataset = Recording()
    checks = _by_name(preflight(DataLoader(dataset, batch_size=4)))
    assert checks["shm"].status == "ok" and checks["open_files"].status == "ok"
    assert checks["db_handles"].status == "ok" and dataset.calls == 0


def test_trainfast_worker_loader(machine: None, db: sqlite3.Connection) -> None:
    dataset = Recording(n=16, db=db)
    loader = make_loader(dataset, 4, workers=2, device="cpu")
    assert isinstance(loader, Loader)
    try:
        workers, prefetch = loader_settings(loader)
        assert (workers, prefetch) == (loader.plan.num_workers, loader.plan.prefetch_factor) == (2, 2)
        checks = _by_name(preflight(loader))
        assert checks["shm"].status == "warn" and "64.0 MiB" in checks["shm"].detail  # tiny, batch size unknown
        assert checks["db_handles"].status == "warn" and "dataset.db" in checks["db_handles"].detail
        assert dataset.calls == 0
    finally:
        loader.close()


def test_trainfast_tensor_loader_needs_no_workers(machine: None) -> None:
    x, y = torch.zeros(32, 3, 8, 8), torch.zeros(32, dtype=torch.long)
    loader = make_loader((x, y), 8, device="cpu")
    assert isinstance(loader, TensorLoader)
    assert loader_settings(loader) == (0, None)
    assert estimate_batch_bytes(loader) == 8 * (3 * 8 * 8 * 4 + 8)
    checks = _by_name(preflight(loader))
    assert [c.status for c in checks.values()] == ["ok", "ok", "ok"]  # no dataset object to scan
    assert loader_settings(TensorLoader([x, y], 8)) == (0, None)  # built without a plan


def test_batch_bytes_is_estimated_for_a_tensor_dataset(machine: None) -> None:
    ds = TensorDataset(torch.zeros(100, 1024, 1024, dtype=torch.uint8))  # 1 MiB rows
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    assert estimate_batch_bytes(loader) == 8 * 2**20
    shm = _by_name(preflight(loader))["shm"]  # 2 x 2 x 8 MiB x 2 = 64 MiB: exactly fits, not twice over
    assert shm.status == "warn" and "64.0 MiB" in shm.detail
    assert estimate_batch_bytes(DataLoader(Recording(), batch_size=4)) is None


class _Odd:
    @property
    def plan(self) -> Any:
        raise RuntimeError("touched plan")

    @property
    def dataset(self) -> Any:
        raise RuntimeError("touched dataset")

    def __iter__(self) -> Any:
        raise AssertionError("preflight iterated the loader")


@pytest.mark.parametrize("loader", [object(), None, [1, 2, 3], _Odd(), iter([1])])
def test_unknown_loaders_never_raise(machine: None, loader: object) -> None:
    checks = preflight(loader)
    assert loader_settings(loader) == (None, None)
    assert [c.name for c in checks] == ["cpu", "shm", "open_files"]
    assert _by_name(checks)["cpu"].status == "info"


def test_environment_has_the_contract_fields_with_their_types() -> None:
    env = environment()
    assert set(CONTRACT_FIELDS) <= set(env)
    assert isinstance(env["python"], str) and isinstance(env["torch"], str)
    assert env["cuda_available"] is torch.cuda.is_available()
    assert env["cpu_count"] is None or isinstance(env["cpu_count"], int)
    assert isinstance(env["cpu_affinity"], int) and env["cpu_affinity"] >= 1
    assert env["cgroup_cpu_limit"] is None or isinstance(env["cgroup_cpu_limit"], float)
    assert isinstance(env["memory_bytes"], int) and env["memory_bytes"] > 0
    assert env["shm_bytes"] is None or isinstance(env["shm_bytes"], int)
    assert isinstance(env["gpus"], list)
    for gpu in env["gpus"]:
        assert set(gpu) == {"index", "name", "capability", "memory_bytes"}
    names = [c["name"] for c in env["checks"]]
    assert names == ["cpu", "shm", "open_files", "cuda_versions", "nvml", "tf32", "cuda_alloc_conf"]
    for c in env["checks"]:
        assert set(c) == {"name", "status", "detail", "fix"} and c["status"] in ("ok", "warn", "fail", "info")
    assert json.loads(json.dumps(env)) == env  # plain JSON values only


def test_bug_report_block() -> None:
    env = {"python": "3.11.7", "torch": "2.13.0", "trainfast": "0.1.0", "torch_cuda": "12.8", "cudnn": 91002,
           "driver": "570.1", "cuda_available": True, "cpu_count": 64, "cpu_affinity": 64, "cgroup_cpu_limit": 8.0,
           "usable_cpus": 8, "memory_bytes": 64 * 2**30, "shm_bytes": 64 * 2**20,
           "gpus": [{"index": 0, "name": "NVIDIA H100", "capability": [9, 0], "memory_bytes": 80 * 2**30}],
           "checks": [Check("shm", "warn", "only 64.0 MiB").to_json(), Check("cpu", "ok", "fine").to_json(),
                      Check("x", "fail", "broken").to_json()]}
    block = bug_report_block(env)
    lines = block.splitlines()
    assert lines[0] == "```text" and lines[-1] == "```"
    assert "torch 2.13.0 (CUDA 12.8) | cuDNN 91002 | driver 570.1" in block
    assert "CPUs: 8 usable (os.cpu_count 64, affinity 64, cgroup quota 8)" in block
    assert "memory: 64.0 GiB | /dev/shm free: 64.0 MiB" in block
    assert "GPU 0: NVIDIA H100 (sm_90, 80.0 GiB)" in block
    assert "[fail] x: broken" in block and "[warn] shm: only 64.0 MiB" in block and "cpu: fine" not in block
    assert block.index("[fail]") < block.index("[warn]")


def test_bug_report_block_of_this_machine_and_of_a_sparse_dict() -> None:
    block = bug_report_block(environment())
    assert block.startswith("```text\n") and block.endswith("\n```") and "torch " in block
    sparse = bug_report_block({})
    assert "unknown" in sparse and "GPUs: none" in sparse and "checks: all ok" in sparse


def test_environment_on_a_faked_ampere_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU wiring without a GPU: device properties feed `gpus`, the capability feeds the TF32 check."""
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(checks_module, "read_tf32_settings", lambda: ("highest", True))
    monkeypatch.setattr(checks_module, "read_cuda_alloc_conf", lambda: None)
    env = environment()
    assert env["cuda_available"] is True
    assert env["gpus"] == [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": [9, 0],
                            "memory_bytes": 80 * 2**30}]
    checks = {c["name"]: c for c in env["checks"]}
    assert checks["tf32"]["status"] == "warn" and "sm_90" in checks["tf32"]["detail"]
    assert "expandable_segments:True" in checks["cuda_alloc_conf"]["fix"]
    assert "GPU 0: NVIDIA H100 80GB HBM3 (sm_90, 80.0 GiB)" in bug_report_block(env)
