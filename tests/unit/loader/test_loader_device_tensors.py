"""In-memory tensors already on a device: gathered there with an index on their device, never pinned.

The `meta` device stands in for a GPU (tensors with shapes but no storage); spies on `Tensor.pin_memory`,
`Tensor.index_select` and `Tensor.to` record what would run on CUDA.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from trainfast.loader import TensorLoader, make_loader
from trainfast.loader.auto import plan_loader
from trainfast.loader.memory import index_on

META = torch.device("meta")


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Devices of the tensors `pin_memory()` was called on (pinning itself faked: this build has no CUDA)."""
    calls: list[torch.device] = []

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        calls.append(self.device)
        if self.device.type != "cpu":
            raise RuntimeError(f"cannot pin a {self.device.type} tensor: only dense CPU tensors can be pinned")
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return calls


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.device, torch.device]]:
    """(tensor device, index device) of every `index_select` (meta accepts a CPU index, CUDA does not)."""
    calls: list[tuple[torch.device, torch.device]] = []
    original = torch.Tensor.index_select

    def index_select(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        calls.append((self.device, index.device))
        return original(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    return calls


def device_data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(n, 3, 4, 4, dtype=torch.uint8, device=META), torch.empty(n, dtype=torch.int64, device=META)


@pytest.mark.parametrize("shuffle", [True, False])
def test_device_tensors_are_never_pinned(pinned: list[torch.device], shuffle: bool) -> None:
    loader = TensorLoader(device_data(), 4, shuffle=shuffle, pin_memory=True)
    batches = list(loader)
    assert len(batches) == 3 and all(b[0].device == META for b in batches)
    assert pinned == [] and loader.pin_memory is False


def test_only_the_host_tensors_of_a_mixed_loader_are_pinned(pinned: list[torch.device]) -> None:
    x, _ = device_data()
    loader = TensorLoader((x, torch.arange(10)), 5, shuffle=True, pin_memory=True)
    assert len(list(loader)) == 2
    assert pinned == [torch.device("cpu")] * 2 and loader.pin_memory is True


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_the_index_is_made_on_the_tensors_device(gathers: list[tuple[torch.device, torch.device]], rank: int,
                                                 world: int) -> None:
    loader = TensorLoader(device_data(), 4, shuffle=True, rank=rank, world_size=world)
    assert len(list(loader)) == len(loader)
    assert gathers and all(index == tensor == META for tensor, index in gathers)


def test_mixed_devices_each_get_their_own_index(gathers: list[tuple[torch.device, torch.device]]) -> None:
    x, _ = device_data()
    host = torch.arange(10)
    loader = TensorLoader((x, host), 4, shuffle=True, seed=3)
    got = [b[1] for b in loader]
    assert sorted(gathers, key=str) == sorted([(META, META), (torch.device("cpu"),) * 2] * 3, key=str)
    reference = [b[1] for b in TensorLoader((torch.zeros(10), host), 4, shuffle=True, seed=3)]
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))  # same order as on the host


def test_a_cuda_index_is_copied_once_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking copy (or one from pageable memory) may wait for the queued kernels: once per batch."""
    events: list[tuple[Any, ...]] = []

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        events.append(("pin",))
        return self

    def to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        events.append(("to", torch.device(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    cuda = torch.device("cuda", 1)
    index = index_on(np.arange(3, 7), cuda)
    assert events == [("pin",), ("to", cuda, True)]
    assert index.tolist() == [3, 4, 5, 6]


def test_a_cpu_index_is_not_copied() -> None:
    idx = np.arange(4)
    index = index_on(idx, torch.device("cpu"))
    assert index.data_ptr() == idx.ctypes.data  # shares the array's memory


@pytest.mark.parametrize(("given", "reason"), [
    ("auto", "pin_memory=False (tensors already on the device: no host-to-device copy to speed up)"),
    (True, "pin_memory=True ignored: the tensors are already on the device and only host memory can be pinned"),
    (False, "pin_memory=False (tensors already on the device: no host-to-device copy to speed up)"),
])
def test_plan_does_not_pin_tensors_already_on_the_device(given: bool | str, reason: str) -> None:
    plan = plan_loader(workers="auto", pin_memory=given, prefetch_factor="auto",  # type: ignore[arg-type]
                       persistent_workers="auto", drop_last="auto", shuffle=True, dataset_len=10, in_memory=True,
                       target="cuda", cpus=2, on_device=True)
    assert plan.pin_memory is False
    assert [r for r in plan.reasons if r.startswith("pin_memory")] == [reason]


@pytest.mark.parametrize("pin", ["auto", True])
def test_make_loader_with_device_tensors_for_cuda(pinned: list[torch.device],
                                                  gathers: list[tuple[torch.device, torch.device]],
                                                  pin: bool | str) -> None:
    loader = make_loader(device_data(), 4, device="cuda", pin_memory=pin)  # type: ignore[arg-type]
    assert isinstance(loader, TensorLoader) and loader.plan is not None
    assert loader.plan.pin_memory is False and loader.pin_memory is False
    assert any("already on the device" in r for r in loader.plan.reasons)
    assert len(list(loader)) == 2
    assert pinned == [] and gathers and all(index == META for _, index in gathers)


def test_make_loader_still_pins_host_tensors_for_cuda(pinned: list[torch.device]) -> None:
    loader = make_loader((torch.zeros(8, 2), torch.arange(8)), 4, device="cuda")
    assert loader.plan is not None and loader.plan.pin_memory is True
    assert len(list(loader)) == 2 and pinned == [torch.device("cpu")] * 4


def test_worker_processes_with_device_tensors_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"workers=2 with tensors on meta: .*use workers=0"):
        make_loader(device_data(), 4, device="cuda", workers=2)
