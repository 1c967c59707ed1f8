"""Which NVML GPU is torch's cuda:i (matched by UUID or PCI location, never by number), and a series' mean over a
time window: the doctor's GPU utilisation is this process's GPU over the measured steps only."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import helpers
from trainfast.monitor import Monitor, NvmlSource
from trainfast.monitor.analysis import window_mean
from trainfast.monitor.sources import GpuIdentity, cuda_identity


def fake_pynvml(gpus: int = 8, busy: int = 5, uuid_bytes: bool = False) -> types.ModuleType:
    """`gpus` GPUs, only NVML's `busy` one at 95 %; GPU i has UUID GPU-aaaaaaaa-...-{i:012d} and PCI bus 0x10 + i."""
    def uuid(i: int) -> str | bytes:
        text = f"GPU-AAAAAAAA-0000-0000-0000-{i:012d}"
        return text.encode() if uuid_bytes else text
    return helpers.fake_pynvml(gpus, uuid=uuid, bus=lambda i: 0x10 + i, util=lambda i: 95 if i == busy else 0,
                               busId=b"")


def visible(monkeypatch: pytest.MonkeyPatch, nvml_indices: list[int], uuid: bool = True, pci: bool = True) -> None:
    """torch sees the GPUs `nvml_indices` (CUDA_VISIBLE_DEVICES order) as cuda:0, cuda:1, ..."""
    def properties(index: int) -> Any:
        i = nvml_indices[index]
        props = types.SimpleNamespace(total_memory=1)
        if uuid:
            props.uuid = f"aaaaaaaa-0000-0000-0000-{i:012d}"  # torch prints it without NVML's "GPU-"
        if pci:
            props.pci_domain_id, props.pci_bus_id, props.pci_device_id = 0, 0x10 + i, 0
        return props
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)


@pytest.mark.parametrize("uuid_bytes", [False, True])
def test_torch_gpus_are_matched_to_nvml_by_uuid(monkeypatch: pytest.MonkeyPatch, uuid_bytes: bool) -> None:
    """CUDA_VISIBLE_DEVICES=5,2 on an 8-GPU node: cuda:0 is NVML's GPU 5, cuda:1 its GPU 2."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(uuid_bytes=uuid_bytes))
    visible(monkeypatch, [5, 2], pci=False)
    with Monitor(interval_s=3600, sources=[NvmlSource()]) as monitor:
        assert [monitor.nvml_index(0), monitor.nvml_index(1)] == [5, 2]


def test_pci_location_when_there_is_no_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    visible(monkeypatch, [7], uuid=False)
    assert cuda_identity(0) == GpuIdentity(None, (0, 0x17, 0))
    source = NvmlSource()
    assert source.index_of(GpuIdentity(None, (0, 0x17, 0))) == 7
    assert source.index_of(GpuIdentity("no-such-gpu", None)) is None  # no guess among 8
    source.close()
    assert source.index_of(GpuIdentity(None, (0, 0x13, 0))) == 3  # identities outlive NVML's shutdown


def test_the_only_gpu_needs_no_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1, busy=0))
    source = NvmlSource()
    assert source.index_of(GpuIdentity(None, None)) == 0
    source.close()


def test_no_identity_is_asked_before_the_process_initialised_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: asked.append(i))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    with Monitor(interval_s=3600, sources=[NvmlSource()]) as monitor:
        assert monitor.nvml_index(0) is None and cuda_identity(0) is None
    assert asked == []


def test_without_nvml_there_is_no_index() -> None:
    with Monitor(interval_s=3600, sources=[]) as monitor:
        assert monitor.nvml_index(0) is None


@pytest.mark.parametrize(("since", "until", "mean"), [(2.0, 4.0, 90.0), (0.0, 10.0, 58.0), (4.5, 4.9, None)])
def test_window_mean_keeps_the_samples_inside(since: float, until: float, mean: float | None) -> None:
    times, values = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 10.0, 80.0, 100.0, 90.0, 68.0]
    assert window_mean(times, values, since, until) == (pytest.approx(mean) if mean is not None else None)


def test_window_mean_rejects_mismatched_series() -> None:
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        window_mean([0.0, 1.0], [1.0], 0.0, 1.0)
