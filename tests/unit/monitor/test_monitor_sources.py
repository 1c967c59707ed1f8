"""sources.py: psutil (real, with a real child process), NVML (real-unavailable and a fake pynvml),
torch.cuda (patched) and the FakeSource used by the other tests."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
import types
from multiprocessing.synchronize import Event
from typing import Any

import psutil
import pytest
import torch

from helpers import FakeNVMLError
from trainfast.monitor import FakeSource, Monitor, NvmlSource, PsutilSource, Source, TorchCudaSource, sources

MIB = 2**20


def test_sources_satisfy_the_protocol() -> None:
    for source in (PsutilSource(), NvmlSource(), TorchCudaSource(), FakeSource({"a": [1.0]})):
        assert isinstance(source, Source)
        source.close()


# ---- FakeSource ----------------------------------------------------------------------------------------

def test_fake_source_replays_then_repeats_the_last_value() -> None:
    fake = FakeSource({"a": [1, 2, 3], "b": [7.5]}, name="replay")
    assert fake.name == "replay" and fake.available
    assert [fake.sample() for _ in range(5)] == [
        {"a": 1.0, "b": 7.5}, {"a": 2.0, "b": 7.5}, {"a": 3.0, "b": 7.5}, {"a": 3.0, "b": 7.5}, {"a": 3.0, "b": 7.5}]
    assert fake.calls == 5
    fake.close()
    assert fake.closed


def test_fake_source_rejects_an_empty_series() -> None:
    with pytest.raises(ValueError, match=r"empty: \['b', 'c'\]"):
        FakeSource({"a": [1.0], "c": [], "b": ()})


# ---- PsutilSource --------------------------------------------------------------------------------------

def test_psutil_sample_has_system_and_process_metrics() -> None:
    source = PsutilSource()
    assert source.available and source.unavailable_reason is None
    sample = source.sample()
    cores = len(psutil.cpu_times(percpu=True))
    assert {"cpu.percent", "ram.used_bytes", "ram.percent", "proc.cpu_percent", "proc.rss_bytes", "workers.count",
            "workers.cpu_percent", "workers.rss_bytes", "workers.max_rss_bytes"} <= set(sample)
    assert {f"cpu{i}.percent" for i in range(cores)} <= set(sample)
    assert 0.0 <= sample["cpu.percent"] <= 100.0
    assert all(0.0 <= sample[f"cpu{i}.percent"] <= 100.0 for i in range(cores))
    assert sample["proc.rss_bytes"] > 1e6  # a Python process with torch loaded
    assert sample["ram.used_bytes"] > 0.0 and 0.0 < sample["ram.percent"] <= 100.0
    assert all(isinstance(v, float) for v in sample.values())
    source.close()


def test_psutil_measures_busy_cpu() -> None:
    source = PsutilSource()
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    while time.process_time() - cpu_start < 0.1:  # burn 0.1 s of CPU, however loaded the machine is
        pass
    sample = source.sample()
    expected = 100.0 * (time.process_time() - cpu_start) / (time.perf_counter() - wall_start)
    assert sample["proc.cpu_percent"] == pytest.approx(expected, abs=20.0)  # /proc counts 10 ms ticks
    assert sample["cpu.percent"] > 0.0


def test_psutil_per_core_can_be_turned_off() -> None:
    sample = PsutilSource(per_core=False).sample()
    assert "cpu.percent" in sample
    assert not any(k.startswith("cpu") and k != "cpu.percent" for k in sample)


def test_psutil_sees_a_child_process_and_forgets_it_when_gone() -> None:
    source = PsutilSource()
    before = source.sample()["workers.count"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        with_child = source.sample()
        assert with_child["workers.count"] >= before + 1
        assert with_child["workers.rss_bytes"] > 0.0
        assert with_child["workers.max_rss_bytes"] <= with_child["workers.rss_bytes"]
        assert with_child["workers.cpu_percent"] >= 0.0
        child.kill()
        source.sample()  # the child may be a zombie now (killed, not yet reaped): must not raise
    finally:
        child.kill()
        child.wait()
    assert source.sample()["workers.count"] == before


def test_psutil_watches_another_pid_and_survives_its_exit() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    try:
        source = PsutilSource(pid=child.pid)
        assert source.available
        assert source.sample()["proc.rss_bytes"] > 0.0
    finally:
        child.kill()
        child.wait()
    sample = source.sample()  # the process is gone: system metrics only, no exception
    assert "cpu.percent" in sample and "proc.rss_bytes" not in sample


def test_psutil_unavailable_for_a_process_that_is_gone() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    source = PsutilSource(pid=done.pid)
    assert not source.available
    assert str(done.pid) in (source.unavailable_reason or "")
    assert source.sample() == {}


def _write_every_page(buffer: bytearray, go: Event, done: Event) -> None:
    """A forked child that writes into memory it inherited, as refcount updates do to a Python list's objects."""
    go.wait(30)
    for i in range(0, len(buffer), 4096):
        buffer[i] = 2
    done.set()
    time.sleep(30)  # killed by the test


@pytest.mark.skipif(not sources._SMAPS_ROLLUP, reason="needs /proc/<pid>/smaps_rollup (Linux 4.14+)")
def test_private_bytes_see_inherited_pages_copied_where_rss_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "PRIVATE_CPU_SHARE", 1.0)  # a pass at every sample
    inherited = bytearray(b"\x01") * (64 * MIB)  # written, so resident in this process before the fork
    context = multiprocessing.get_context("fork")
    go, done = context.Event(), context.Event()
    child = context.Process(target=_write_every_page, args=(inherited, go, done), daemon=True)
    source = PsutilSource(per_core=False)
    child.start()
    try:
        time.sleep(0.2)
        before = source.sample()
        go.set()
        assert done.wait(30)
        time.sleep(0.05)
        after = source.sample()
    finally:
        child.kill()
        child.join()
    assert after["workers.count"] == before["workers.count"] >= 1
    copied = after["workers.private_bytes"] - before["workers.private_bytes"]
    assert 60 * MIB < copied < 80 * MIB  # every page of the buffer, now the child's own
    assert abs(after["workers.rss_bytes"] - before["workers.rss_bytes"]) < 8 * MIB  # RSS had them from the fork


def test_started_counts_workers_replaced_between_samples() -> None:
    source = PsutilSource(per_core=False)
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = source.sample()
    finally:
        first.kill()
        first.wait()
    second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = source.sample()
        again = source.sample()
    finally:
        second.kill()
        second.wait()
    assert after["workers.count"] == before["workers.count"]  # as many workers, but not the same ones
    assert after["workers.started"] == before["workers.started"] + 1
    assert again["workers.started"] == after["workers.started"]


def test_an_exited_worker_not_yet_reaped_is_not_a_worker() -> None:
    source = PsutilSource(per_core=False)
    before = source.sample()["workers.count"]
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert source.sample()["workers.count"] == before  # a zombie: RSS 0 and no memory map to read
    finally:
        child.wait()


def test_private_bytes_are_read_within_their_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that took 20 ms of CPU is not repeated before 20 ms / share of the machine's CPU time has passed."""
    def costly(pid: int) -> float:
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass
        return float(MIB)

    monkeypatch.setattr(sources, "_SMAPS_ROLLUP", True)
    monkeypatch.setattr(sources, "_private_bytes", costly)
    monkeypatch.setattr(sources, "PRIVATE_CPU_SHARE", 1e-4)  # next pass after 200 s / cores
    source = PsutilSource(per_core=False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        first, second = source.sample(), source.sample()
    finally:
        child.kill()
        child.wait()
    assert first["workers.private_bytes"] == first["workers.count"] * MIB
    assert "workers.private_bytes" not in second and "workers.count" in second  # the other metrics as always


@pytest.mark.parametrize("pid", [-1, "1", 1.5, True])
def test_psutil_rejects_a_bad_pid(pid: object) -> None:
    with pytest.raises(ValueError, match="pid must be a process id.*got " + repr(pid)):
        PsutilSource(pid=pid)  # type: ignore[arg-type]


# ---- NvmlSource ----------------------------------------------------------------------------------------

def _driver_present() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_driver_present(), reason="this machine has an NVIDIA driver")
def test_nvml_unavailable_without_a_driver() -> None:
    source = NvmlSource()
    assert not source.available
    assert "nvmlInit failed" in (source.unavailable_reason or "")
    assert source.sample() == {}
    source.close()
    source.close()


def test_nvml_unavailable_when_pynvml_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    source = NvmlSource()
    assert not source.available
    assert "pip install nvidia-ml-py" in (source.unavailable_reason or "")
    assert source.sample() == {}


def fake_pynvml(gpus: int = 2, init_error: Exception | None = None,
                unsupported: frozenset[str] = frozenset()) -> types.ModuleType:
    """A stand-in for the pynvml module: GPU i is 40 + i % busy, uses (i + 1) GiB of 80, 60 + i °C and
    (250 + i) W, reported in NVML's units (bytes, °C, milliwatts)."""
    module: Any = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.NVML_TEMPERATURE_GPU = 0
    module.calls = {"init": 0, "shutdown": 0}

    def check(query: str) -> None:
        if query in unsupported:
            raise FakeNVMLError("Not Supported")

    def init() -> None:
        module.calls["init"] += 1
        if init_error is not None:
            raise init_error

    def shutdown() -> None:
        module.calls["shutdown"] += 1

    def utilization(handle: int) -> Any:
        check("util")
        return types.SimpleNamespace(gpu=40 + handle, memory=10)

    def memory(handle: int) -> Any:
        check("memory")
        return types.SimpleNamespace(used=(handle + 1) * 2**30, total=80 * 2**30, free=(79 - handle) * 2**30)

    def temperature(handle: int, sensor: int) -> int:
        check("temp")
        assert sensor == module.NVML_TEMPERATURE_GPU
        return 60 + handle

    def power(handle: int) -> int:
        check("power")
        return (250 + handle) * 1000

    module.nvmlInit = init
    module.nvmlShutdown = shutdown
    module.nvmlDeviceGetCount = lambda: gpus
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetUtilizationRates = utilization
    module.nvmlDeviceGetMemoryInfo = memory
    module.nvmlDeviceGetTemperature = temperature
    module.nvmlDeviceGetPowerUsage = power
    return module  # type: ignore[no-any-return]


def test_nvml_reads_every_gpu_in_the_right_units(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    source = NvmlSource()
    assert source.available and source.unavailable_reason is None
    assert source.sample() == {
        "gpu0.util": 40.0, "gpu0.mem_used_bytes": 2.0**30, "gpu0.mem_total_bytes": 80 * 2.0**30,
        "gpu0.temp_c": 60.0, "gpu0.power_w": 250.0,
        "gpu1.util": 41.0, "gpu1.mem_used_bytes": 2 * 2.0**30, "gpu1.mem_total_bytes": 80 * 2.0**30,
        "gpu1.temp_c": 61.0, "gpu1.power_w": 251.0,
    }
    source.close()
    source.close()
    assert module.calls == {"init": 1, "shutdown": 1}
    assert not source.available and source.sample() == {}


def test_nvml_leaves_out_queries_a_gpu_does_not_support(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus=1, unsupported=frozenset({"power", "temp"})))
    source = NvmlSource()
    assert source.sample() == {"gpu0.util": 40.0, "gpu0.mem_used_bytes": 2.0**30, "gpu0.mem_total_bytes": 80 * 2.0**30}
    source.close()


def test_nvml_init_failure_is_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml(init_error=FakeNVMLError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    source = NvmlSource()
    assert not source.available
    assert source.unavailable_reason is not None
    assert "nvmlInit failed" in source.unavailable_reason and "Driver Not Loaded" in source.unavailable_reason
    assert source.sample() == {}
    source.close()
    assert module.calls["shutdown"] == 0  # nothing was initialised


def test_nvml_without_gpus_is_unavailable_and_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml(gpus=0)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    source = NvmlSource()
    assert not source.available and source.unavailable_reason == "NVML is installed but sees no GPU"
    assert module.calls == {"init": 1, "shutdown": 1}


def test_monitor_samples_fake_gpus_and_shuts_nvml_down(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    with Monitor(interval_s=0.005, sources=[NvmlSource()]) as monitor:
        pass
    assert monitor.summary()["gpu1.power_w"].last == 251.0
    assert monitor.gpu_sawtooth() == {"gpu0.util": False, "gpu1.util": False}
    assert module.calls["shutdown"] == 1


def test_a_bug_in_an_nvml_call_reaches_the_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only NVML's own errors are swallowed as "not readable"; anything else disables the source visibly."""
    module = fake_pynvml(gpus=1)
    del module.nvmlDeviceGetPowerUsage
    monkeypatch.setitem(sys.modules, "pynvml", module)
    with Monitor(interval_s=0.005, sources=[NvmlSource()]) as monitor:
        pass
    assert monitor.errors["nvml"].startswith("AttributeError")
    assert monitor.sources == ()
    assert module.calls["shutdown"] == 1


# ---- TorchCudaSource -----------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_torch_cuda_unavailable_without_cuda() -> None:
    source = TorchCudaSource()
    assert not source.available
    assert "torch.cuda.is_available() is False" in (source.unavailable_reason or "")
    assert source.sample() == {}


def test_torch_cuda_reads_the_allocator_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    initialised = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 100 * (i + 1))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 200 * (i + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: 150 * (i + 1))
    source = TorchCudaSource()
    assert source.available
    assert source.sample() == {}  # the monitor must not be the one to create a CUDA context
    initialised = True
    assert source.sample() == {
        "cuda0.allocated_bytes": 100.0, "cuda0.reserved_bytes": 200.0, "cuda0.max_allocated_bytes": 150.0,
        "cuda1.allocated_bytes": 200.0, "cuda1.reserved_bytes": 400.0, "cuda1.max_allocated_bytes": 300.0,
    }
    source.close()


def test_multiprocessing_helpers_are_not_workers() -> None:
    """A resource tracker lives as long as the process once anything started one (a spawn loader, shared memory):
    it is a descendant, not a loader worker, and a later run's worker count must not include it."""
    import multiprocessing.resource_tracker as tracker

    tracker.ensure_running()
    source = PsutilSource(per_core=False)
    assert source.sample()["workers.count"] == 0
