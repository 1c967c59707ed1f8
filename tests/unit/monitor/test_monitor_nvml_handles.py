"""NVML with one GPU that cannot be opened (hidden from a container: NVML_ERROR_NO_PERMISSION; fallen off the bus:
NVML_ERROR_GPU_IS_LOST): the other GPUs are still read, under their own NVML index, and still matched to torch's.

The fake pynvml raises what the installed nvidia-ml-py raises: its `NVMLError(code)`, which becomes the code's
subclass (NVMLError_NoPermission, ...) as in its `_nvmlCheckReturn`; no driver is needed to build one or print it."""

from __future__ import annotations

import logging
import sys
import types

import pynvml as real_nvml
import pytest

import helpers
from trainfast.monitor import NvmlSource
from trainfast.monitor.sources import GpuIdentity


def fake_pynvml(gpus: int, broken: dict[int, int]) -> types.ModuleType:
    """`gpus` GPUs; `nvmlDeviceGetHandleByIndex(i)` fails with NVML error code `broken[i]`. GPU i: UUID
    GPU-...-{i:012d}, PCI bus 0x10 + i, utilisation 10 * i %."""
    def handle(index: int) -> int:
        if index in broken:
            raise real_nvml.NVMLError(broken[index])  # what the real binding's _nvmlCheckReturn raises
        return index
    return helpers.fake_pynvml(gpus, uuid=lambda i: f"GPU-aaaaaaaa-0000-0000-0000-{i:012d}", bus=lambda i: 0x10 + i,
                               util=lambda i: 10 * i, handle=handle, error=real_nvml.NVMLError,
                               temperature_gpu=real_nvml.NVML_TEMPERATURE_GPU)


@pytest.mark.parametrize(("code", "error"), [
    (real_nvml.NVML_ERROR_NO_PERMISSION, "NVMLError_NoPermission: Insufficient Permissions"),
    (real_nvml.NVML_ERROR_GPU_IS_LOST, "NVMLError_GpuIsLost: GPU is lost"),
])
def test_a_gpu_that_cannot_be_opened_is_skipped_and_the_others_read(code: int, error: str,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=3, broken={1: code}))
    with caplog.at_level(logging.WARNING, logger="trainfast.monitor"):
        source = NvmlSource()
    assert source.available, source.unavailable_reason
    sample = source.sample()
    assert {key.split(".")[0] for key in sample} == {"gpu0", "gpu2"}  # NVML's own indices, GPU 1 left out
    assert sample["gpu2.util"] == 20.0
    [record] = [r for r in caplog.records if r.name.startswith("trainfast")]
    assert f"GPU 1 skipped: nvmlDeviceGetHandleByIndex(1) failed ({error})" in record.getMessage()
    assert source.skipped == {1: error}
    source.close()


def test_torchs_gpu_is_still_matched_by_identity_past_a_skipped_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=2: torch's cuda:0 is NVML's GPU 2, whatever NVML could not open before it."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=3, broken={0: real_nvml.NVML_ERROR_NO_PERMISSION}))
    source = NvmlSource()
    assert source.index_of(GpuIdentity("aaaaaaaa-0000-0000-0000-000000000002", None)) == 2
    assert source.index_of(GpuIdentity(None, (0, 0x12, 0))) == 2
    assert source.index_of(GpuIdentity(None, None)) is None  # 3 GPUs: no guess, the skipped one included
    source.close()


def test_no_gpu_that_can_be_opened_is_unavailable_with_each_error(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = {0: real_nvml.NVML_ERROR_NO_PERMISSION, 1: real_nvml.NVML_ERROR_GPU_IS_LOST}
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=2, broken=broken))
    source = NvmlSource()
    assert not source.available and source.sample() == {}
    assert source.unavailable_reason == ("NVML sees 2 GPU(s) but could open none: GPU 0: NVMLError_NoPermission: "
                                         "Insufficient Permissions; GPU 1: NVMLError_GpuIsLost: GPU is lost")
