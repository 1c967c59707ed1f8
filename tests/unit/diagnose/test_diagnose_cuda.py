"""The doctor's CUDA inputs, reached on the CPU through fakes: events on the model's device only, copies timed by
their own events, NVML for this process's GPU over the measured steps, bf16 and peak memory of the model's GPU.

The fake device: each stream keeps the host time its queued work ends (`busy_until`); an event completes when the
work queued before it does, so two events bracket exactly the device work between them, as CUDA's do. Parameters
and tensors claim a CUDA device through a subclass whose `device` says so; their data stays on the CPU.
"""

from __future__ import annotations

import gc
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import helpers
from trainfast.diagnose.capture.devicetime import DeviceTimer
from trainfast.diagnose.capture.instrument import Instrumentation
from trainfast.diagnose.capture.timeline import Timeline
from trainfast.diagnose.evidence.evidence import evidence_of
from trainfast.diagnose.run import build_report
from trainfast.monitor import Monitor, NvmlSource

# The model's kernels per step, queued asynchronously: 30x the copy, and far above what load adds to a step's host
# work (at 18 ms, 8 ms of a busy machine's delay before the forward crossed a bound of KERNEL_S / 3).
KERNEL_S = 0.06
COPY_S = 0.002  # the host-to-device copy itself


class FakeStream:
    def __init__(self, index: int) -> None:
        self.index = index
        self.busy_until = 0.0  # perf_counter time when the work queued so far ends

    def launch(self, seconds: float) -> None:
        self.busy_until = max(time.perf_counter(), self.busy_until) + seconds


@dataclass
class FakeCuda:
    """What the patched `torch.cuda` recorded."""

    streams: dict[int, FakeStream] = field(default_factory=lambda: {i: FakeStream(i) for i in range(2)})
    events: list[Any] = field(default_factory=list)
    synchronized: list[Any] = field(default_factory=list)
    initialized: bool = True

    def stream(self, device: Any = None) -> FakeStream:
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
        return self.streams[0 if index is None else index]  # None: the current device, 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    cuda = FakeCuda()

    class FakeEvent:
        def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
            cuda.events.append(self)
            self.stream: FakeStream | None = None

        def record(self, stream: FakeStream | None = None) -> None:
            self.stream = stream
            self.t = max(time.perf_counter(), stream.busy_until if stream is not None else 0.0)

        def elapsed_time(self, end: FakeEvent) -> float:
            return (end.t - self.t) * 1000

    for name, value in {"is_available": lambda: True, "is_initialized": lambda: cuda.initialized,
                        "Event": FakeEvent, "current_stream": cuda.stream, "current_device": lambda: 0,
                        "synchronize": lambda device=None: cuda.synchronized.append(device),
                        "get_device_capability": lambda device=None: {0: (7, 5), 1: (8, 0)}[_index(device)],
                        "max_memory_allocated": lambda device=None: {0: 1 << 30, 1: 6 << 30}[_index(device)],
                        "get_device_properties": lambda device=None: types.SimpleNamespace(
                            total_memory=8 << 30, uuid=f"00000000-0000-0000-0000-00000000000{_index(device)}",
                            pci_domain_id=0, pci_bus_id=0x30 + _index(device), pci_device_id=0,
                            major=7 + _index(device), minor=5 * (1 - _index(device)))}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    yield cuda


def _index(device: Any) -> int:
    index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
    return 0 if index is None else int(index)  # None: the current device, 0


def on_fake_cuda(model: nn.Module, index: int) -> nn.Module:
    """The model's parameters claim `cuda:{index}` (their data stays on the CPU)."""
    cls = type(f"Cuda{index}Parameter", (nn.Parameter,), {"device": property(lambda self: torch.device("cuda", index))})
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = cls(param.detach().clone())
    return model


class Cuda0Tensor(torch.Tensor):
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


@pytest.fixture
def blocking_copies(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """`Tensor.to("cuda")` as a blocking copy from pageable memory: it waits for every kernel queued on the
    stream, then copies for COPY_S."""
    real_to = torch.Tensor.to

    def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or device.type != "cuda":
            return real_to(tensor, *args, **kwargs)
        stream = fake_cuda.stream(device)
        stream.launch(COPY_S)
        time.sleep(max(0.0, stream.busy_until - time.perf_counter()))
        return tensor.as_subclass(Cuda0Tensor)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return fake_cuda


def cpu_loop(timeline: Timeline, steps: int = 8) -> Instrumentation:
    data = TensorDataset(torch.randn(8 * steps, 4), torch.randint(0, 2, (8 * steps,)))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Instrumentation(timeline) as inst:
        for x, y in DataLoader(data, batch_size=8):
            loss = nn.functional.cross_entropy(model(x.to(torch.float32)), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return inst


def test_a_cpu_only_script_on_a_gpu_host_creates_no_event(fake_cuda: FakeCuda) -> None:
    """Recording an event creates a CUDA context: a script that never touches CUDA must not get one."""
    fake_cuda.initialized = False
    timeline = Timeline(warmup_steps=1)
    inst = cpu_loop(timeline)
    report = build_report(timeline, inst).to_json()
    assert len(timeline.records) == 7 and report["observed"]["device"] == "cpu"
    assert fake_cuda.events == [] and fake_cuda.synchronized == []


def test_steps_are_timed_on_the_model_device_stream(fake_cuda: FakeCuda) -> None:
    """A model on cuda:1 while the current device is cuda:0: every event goes on cuda:1's stream, and the GPU
    time per step comes from them (one synchronize, at report time)."""
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    model = on_fake_cuda(nn.Linear(4, 2), 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timeline = Timeline(warmup_steps=1)
    with Instrumentation(timeline) as inst:
        for x, y in DataLoader(data, batch_size=8):
            nn.functional.cross_entropy(model(x), y).backward()
            fake_cuda.streams[1].launch(0.002)  # the step's kernels
            optimizer.step()
    assert inst.observed.device == "cuda" and inst.observed.device_index == 1
    assert fake_cuda.events and {e.stream.index for e in fake_cuda.events} == {1}
    assert fake_cuda.synchronized == []  # nothing synchronises while the script runs
    seconds = inst.device_timer.step_seconds()
    # a step that starts while the previous one's work is queued starts at `busy_until`: (t + 0.002) - t can
    # round to just under 0.002 at perf_counter's magnitude, hence the tolerance
    assert len(seconds) == len(timeline.records) == 5 and all(s >= 0.002 - 1e-9 for s in seconds)
    assert fake_cuda.synchronized == [torch.device("cuda", 1)]


def test_device_timer_records_nothing_before_cuda_work() -> None:
    made: list[Any] = []
    timer = DeviceTimer(make_event=lambda: made.append(object()), stream_of=lambda device: device)
    timer.batch_ready()
    timer.work_done()
    timer.saw_model(torch.device("cpu"))
    timer.saw_tensor(torch.device("cuda", 0))  # the model is on the CPU: a stray tensor does not move it
    timer.batch_ready()
    assert made == [] and timer.device is None and timer.settled


def test_transfer_is_the_copy_itself_not_the_kernels_it_waited_for(blocking_copies: FakeCuda) -> None:
    """Each step's blocking copy waits ~60 ms for the previous step's kernels, then copies for 2 ms: the host
    timer booked ~62 ms of transfer (a transfer-bound verdict); the copy's events say 2 ms, the rest is compute."""
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = on_fake_cuda(nn.Linear(4, 2), 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timeline = Timeline(warmup_steps=2)
    with Instrumentation(timeline) as inst:
        for x, y in DataLoader(data, batch_size=8):
            x = x.to("cuda")
            nn.functional.cross_entropy(model(x), y).backward()
            blocking_copies.streams[0].launch(KERNEL_S)
            optimizer.step()
    report = build_report(timeline, inst)
    assert len(report.steps) == 6
    # Loose bounds: a sleep that overruns on a busy machine lengthens the fake copy, and the kernels start before the
    # step ends (at launch), so a host delayed in optimizer.step() sees less of their wait in the next step.
    for step in report.steps:
        assert step.total_s > KERNEL_S / 2 and step.transfer_s < KERNEL_S / 2 and step.compute_s > KERNEL_S / 2, step
    assert report.fractions is not None and report.fractions.transfer < 0.25 and report.fractions.compute > 0.6
    assert report.verdict is not None and report.verdict.name != "transfer-bound"
    # pinning still saves part of the copy itself, not the kernels' time (host-timed: "up to 6.9x")
    assert all((r.expected_gain or 1.0) < 1.2 for r in report.recommendations if r.id == "pin_memory")


def test_warm_up_steps_record_no_event(blocking_copies: FakeCuda) -> None:
    timeline = Timeline(warmup_steps=50)
    model = on_fake_cuda(nn.Linear(4, 2), 0)
    with Instrumentation(timeline) as inst:
        for _ in range(3):
            model(torch.randn(8, 4).to("cuda")).sum().backward()
    assert blocking_copies.events == [] and inst.observed.device == "cuda"


def test_without_a_loader_a_copy_before_the_forward_is_not_data_wait(blocking_copies: FakeCuda) -> None:
    """Input prepared in the loop: the blocking copy's wait for the kernels is neither data wait nor transfer."""
    model = on_fake_cuda(nn.Linear(4, 2), 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timeline = Timeline(warmup_steps=1)
    with Instrumentation(timeline) as inst:
        for _ in range(6):
            x = torch.randn(8, 4).to("cuda")
            model(x).sum().backward()
            blocking_copies.streams[0].launch(KERNEL_S)
            optimizer.step()
    report = build_report(timeline, inst)
    assert report.input_source == "script" and len(report.steps) == 5
    for step in report.steps:
        assert step.wait_s < KERNEL_S / 3 and step.transfer_s < KERNEL_S / 2, step


# ---- NVML: this process's GPU, over the measured steps

def fake_pynvml(util: dict[int, float]) -> Any:
    """8 GPUs; NVML's GPU i has UUID GPU-...-00000000000{i - 5} for i >= 5 (the visible ones, renumbered from 0
    by CUDA_VISIBLE_DEVICES=5,6,7) and PCI bus 0x30 + i - 5; `util` is read at each sample."""
    return helpers.fake_pynvml(
        8, uuid=lambda i: f"GPU-00000000-0000-0000-0000-00000000000{i - 5}" if i >= 5 else f"GPU-f{i}",
        bus=lambda i: 0x30 + i - 5 if i >= 5 else i, util=lambda i: util[i])


def test_gpu_utilisation_is_this_process_gpu_over_the_measured_steps(
        fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 GPUs on the node, this process's cuda:0 is NVML's GPU 5: busy while measuring, idle during start-up, the
    other 7 idle throughout. Averaged over every GPU and the whole run, it looked 90 % idle: host-bound."""
    util = dict.fromkeys(range(8), 0.0)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(util))
    model = on_fake_cuda(nn.Linear(4, 2), 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(80, 4), torch.randint(0, 2, (80,))), batch_size=8)
    timeline = Timeline(warmup_steps=4, max_steps=5)
    with Monitor(interval_s=3600, sources=[NvmlSource()]) as monitor:
        deadline = time.monotonic() + 5
        while not monitor.samples():  # the thread's first sample, at start: start-up, idle
            assert time.monotonic() < deadline
            time.sleep(0.001)
        gc.disable()  # a collection of the test session's heap inside one of 5 fetches reads as data wait
        try:
            with Instrumentation(timeline) as inst:
                for x, y in loader:
                    nn.functional.cross_entropy(model(x), y).backward()
                    # the step's own work: no wait, no transfer, no host time to speak of (10 ms: after the whole
                    # suite a fetch took 0.3-0.8 ms, 8-11 % of a 3 ms step, which read as "balanced")
                    time.sleep(0.01)
                    util[5] = 97.0 if timeline.measuring else 0.0
                    monitor._sample_once()
                    optimizer.step()
        finally:
            gc.enable()
        report = build_report(timeline, inst, monitor=monitor)
    assert report.verdict is not None and report.verdict.name == "compute-bound", report.verdict
    observed = report.to_json()["observed"]
    assert observed["gpu_util_devices"] == ["gpu5"] and observed["gpu_util_mean"] == pytest.approx(97.0)


def test_no_nvml_figure_when_the_gpu_cannot_be_matched(fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """No UUID or PCI location matches: another GPU's figure would be worse than none."""
    module = fake_pynvml(dict.fromkeys(range(8), 0.0))
    module.nvmlDeviceGetUUID = lambda i: f"GPU-other-{i}"
    module.nvmlDeviceGetPciInfo = lambda i: types.SimpleNamespace(domain=1, bus=i, device=0)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    with Monitor(interval_s=3600, sources=[NvmlSource()]) as monitor:
        assert monitor.nvml_index(0) is None
        fake_cuda.initialized = False  # before the process initialised CUDA, nothing is asked of it
        assert monitor.nvml_index(0) is None


# ---- the model's GPU, not the current one

def cuda_evidence(index: int) -> Any:
    timeline = Timeline(warmup_steps=0)
    inst = Instrumentation(timeline)
    inst.observed.device, inst.observed.device_index = "cuda", index
    return evidence_of(inst.snapshot(final=True))


def test_bf16_and_peak_memory_are_the_model_device(fake_cuda: FakeCuda) -> None:
    """cuda:0 (current) is a Turing card, cuda:1 (the model's) an Ampere one with 6 of 8 GiB at peak."""
    on_1, on_0 = cuda_evidence(1), cuda_evidence(0)
    assert on_1.bf16_supported and on_1.gpu_memory_fraction == pytest.approx(0.75)
    assert not on_0.bf16_supported and on_0.gpu_memory_fraction == pytest.approx(0.125)
