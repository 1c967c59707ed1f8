"""find_batch_size: the doubling + bisection search against faked out-of-memory errors, what counts as one,
the model left as it was, fragmentation advice from faked CUDA memory numbers, and a real CPU run."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import Scale
from trainfast.precision.policy import device_caps, resolve_precision
from trainfast.tune import batch_size as bs
from trainfast.tune.batch_size import (
    RESOLUTION,
    BatchSizeError,
    MemorySnapshot,
    find_batch_size,
    fragmented,
    is_oom,
    search,
)

GiB = 2**30
CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 16.00 GiB"
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 4611686018427387904 bytes. Error code 12 (Cannot allocate memory)")


class FakeOOM(nn.Module):
    """A small linear model whose forward "runs out of memory" for any batch above `limit`."""

    def __init__(self, limit: int, error: Callable[[], BaseException] = lambda: torch.OutOfMemoryError(CUDA_OOM)):
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.limit, self.error = limit, error
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise self.error()
        out: torch.Tensor = self.net(x)
        return out


def run(limit: int, error: Callable[[], BaseException] | None = None, **kwargs: object) -> bs.BatchSizeResult:
    model = FakeOOM(limit) if error is None else FakeOOM(limit, error)
    return find_batch_size(model, torch.randn(4), device="cpu", **kwargs)  # type: ignore[arg-type]


REAL_RELEASE = bs.free_memory


@pytest.fixture(autouse=True)
def releases(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Counts the frees between tries and skips their gc.collect() (~0.1 s each with torch loaded); tests of
    the real release put it back."""
    calls: list[torch.device] = []
    monkeypatch.setattr(bs, "free_memory", calls.append)
    return calls


@pytest.mark.parametrize(("limit", "first_oom"), [(37, 64), (64, 128), (100, 128), (1, 8), (8, 16)])
def test_finds_the_largest_batch_that_fits(limit: int, first_oom: int) -> None:
    result = run(limit)
    assert result.batch_size == limit
    assert result.first_oom == first_oom
    assert all(fitted == (b <= limit) for b, fitted, _ in result.tried)
    assert result.fragmentation_suspected is False
    auto = resolve_precision("auto", device_caps(torch.device("cpu"))).name  # bf16-mixed on a CPU with native bf16
    assert (result.device, result.precision) == ("cpu", auto)


def test_stops_at_max_batch_without_an_oom(releases: list[torch.device]) -> None:
    result = run(10_000, max_batch=1000)
    assert len(releases) == len(result.tried) + 1  # after every try, and once more when done
    assert result.batch_size == 1000 and result.first_oom is None
    assert [b for b, _, _ in result.tried] == [8, 16, 32, 64, 128, 256, 512, 1000]
    assert "raise max_batch" in result.advice


@pytest.mark.parametrize("limit", [37, 100, 1000, 3000, 4095])
def test_tries_grow_logarithmically(limit: int) -> None:
    result = run(limit)
    doublings = math.ceil(math.log2(4096 / 8)) + 1  # 8, 16, ..., 4096
    assert len(result.tried) <= doublings + math.ceil(math.log2(1 / RESOLUTION)) + 1
    assert len({b for b, _, _ in result.tried}) == len(result.tried)  # no batch tried twice


def test_search_is_within_resolution_for_every_threshold() -> None:
    start, max_batch = 8, 4096
    for limit in range(1, 5000):
        tried: list[int] = []

        def fits(batch: int, limit: int = limit, tried: list[int] = tried) -> bool:
            tried.append(batch)
            return batch <= limit

        best, first_oom = search(fits, start, max_batch)
        assert 1 <= best <= min(limit, max_batch)
        assert min(limit, max_batch) - best <= max(0, int(best * RESOLUTION)), limit
        assert (first_oom is None) == (limit >= max_batch)
        assert len(tried) == len(set(tried)) <= 10 + 6, (limit, tried)


@pytest.mark.parametrize("error", [
    lambda: torch.OutOfMemoryError(CUDA_OOM),
    lambda: torch.cuda.OutOfMemoryError("CUDA out of memory."),
    lambda: RuntimeError("CUDA error: out of memory"),
    lambda: RuntimeError(CPU_OOM),
], ids=["OutOfMemoryError", "cuda.OutOfMemoryError", "RuntimeError", "cpu-allocator"])
def test_each_out_of_memory_form_counts(error: Callable[[], BaseException]) -> None:
    assert is_oom(error())
    assert run(20, error=error).batch_size == 20


class Greedy(nn.Linear):
    """Asks the CPU allocator for more than any address space above 20 samples: a real allocator error."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 20:
            torch.empty(x.shape[0] << 55, dtype=torch.uint8)
        return super().forward(x)


def test_a_real_cpu_allocation_failure_counts() -> None:
    assert find_batch_size(Greedy(4, 3), torch.randn(4), device="cpu").batch_size == 20


def test_other_errors_propagate_unchanged_and_the_model_is_restored() -> None:
    boom = ValueError("a bug in the model")
    model = FakeOOM(20, error=lambda: boom)
    model.eval()
    with pytest.raises(ValueError) as caught:
        find_batch_size(model, torch.randn(4), device="cpu")
    assert caught.value is boom
    assert not model.training and all(p.grad is None for p in model.parameters())


def test_a_torch_runtime_error_that_is_not_oom_propagates() -> None:
    with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
        find_batch_size(nn.Linear(4, 3), torch.randn(5), device="cpu")
    assert not is_oom(caught.value)


def test_modes_buffers_and_grads_are_left_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bs, "free_memory", REAL_RELEASE)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 3))
    model.train()
    model[2].eval()  # a mixed layout must come back module by module
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    result = find_batch_size(model, torch.randn(4), device="cpu", max_batch=32)
    assert result.batch_size == 32
    assert [m.training for m in model.modules()] == [True, True, True, False, True]
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():  # BatchNorm statistics untouched by the repeated sample
        assert torch.equal(v, stats[k]), k


def test_eval_mode_restored_after_a_search_with_ooms() -> None:
    model = FakeOOM(50)
    model.eval()
    seen: list[bool] = []

    def step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append(m.training)
        return torch.as_tensor(m(x)).sum()

    assert find_batch_size(model, torch.randn(4), device="cpu", batch_loss=step).batch_size == 50
    assert all(seen) and not model.training and not model.net.training
    assert all(p.grad is None for p in model.parameters())


def test_even_one_sample_failing_names_shape_and_device() -> None:
    model = FakeOOM(0)
    with pytest.raises(BatchSizeError, match=r"batch of 1 does not fit.*cpu.*\(4,\).*out of memory"):
        find_batch_size(model, torch.randn(4), device="cpu")
    assert model.batches == [8, 4, 2, 1]
    with pytest.raises(BatchSizeError):
        run(0, start=1)


def test_pair_samples_and_batch_loss_get_repeated_batches() -> None:
    got: list[tuple[torch.Size, torch.Tensor]] = []

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        got.append((inputs.shape, targets))
        return F.cross_entropy(model(inputs), targets)

    result = find_batch_size(FakeOOM(12), (torch.randn(4), torch.tensor(2)), device="cpu", batch_loss=step)
    assert result.batch_size == 12
    assert got[0][0] == (8, 4) and torch.equal(got[0][1], torch.full((8,), 2))


def test_the_search_s_loss_is_the_trainer_s_and_the_output_s_mean_without_targets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    seen: list[torch.Tensor] = []
    original = bs.default_batch_loss

    def spy(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen.append(batch[1])
        return original(m, batch)
    monkeypatch.setattr(bs, "default_batch_loss", spy)
    find_batch_size(model, (torch.randn(4), torch.tensor(2)), device="cpu", precision="32-true", max_batch=8)
    assert seen and all(torch.equal(y, torch.full((len(y),), 2)) for y in seen)
    x = torch.randn(5, 4)
    assert torch.equal(bs._outputs_mean(model, x), model(x).float().mean())


def test_forward_runs_under_the_precision_autocast() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return torch.as_tensor(model(x)).float().mean()

    result = find_batch_size(nn.Linear(4, 3), torch.randn(4), device="cpu", precision="bf16-mixed", max_batch=8,
                             batch_loss=step)
    assert result.precision == "bf16-mixed" and seen == [(True, torch.bfloat16)]


def fake_memory(monkeypatch: pytest.MonkeyPatch, allocated: float, reserved: float, total: float = 16) -> None:
    snapshot = MemorySnapshot(int(allocated * GiB), int(reserved * GiB), int(total * GiB))
    monkeypatch.setattr(bs, "_memory_at_oom", lambda device: snapshot)


def test_fragmentation_suggests_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    fake_memory(monkeypatch, allocated=10, reserved=16)  # 6 GiB cached but unusable for a 2 GiB request
    result = run(100)
    assert result.batch_size == 100 and result.fragmentation_suspected
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in result.advice
    assert "6.0 GiB of the 16.0 GiB" in result.advice and "batch 128" in result.advice


def test_expandable_segments_not_suggested_when_already_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    fake_memory(monkeypatch, allocated=10, reserved=16)
    result = run(100)
    assert result.fragmentation_suspected
    assert "expandable_segments:True" not in result.advice and "already sets expandable_segments" in result.advice


def test_no_fragmentation_when_memory_is_really_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    fake_memory(monkeypatch, allocated=15.5, reserved=16)
    result = run(100)
    assert not result.fragmentation_suspected and "PYTORCH_CUDA_ALLOC_CONF" not in result.advice


def test_fragmentation_rule() -> None:
    assert fragmented(MemorySnapshot(10 * GiB, 16 * GiB, 16 * GiB), 2 * GiB)
    assert fragmented(MemorySnapshot(10 * GiB, 16 * GiB, 16 * GiB), None)
    assert not fragmented(MemorySnapshot(10 * GiB, 16 * GiB, 16 * GiB), 20 * GiB)  # too big in any layout
    assert not fragmented(MemorySnapshot(13 * GiB, 16 * GiB, 16 * GiB), 1 * GiB)  # cached share under 25 %
    assert not fragmented(MemorySnapshot(0, 0, 16 * GiB), None)
    assert bs._requested_bytes(CUDA_OOM) == 2 * GiB
    assert bs._requested_bytes(CPU_OOM) == 4611686018427387904
    assert bs._requested_bytes("CUDA out of memory.") is None


def test_logs_one_line_per_try(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("trainfast")
    logger.addHandler(caplog.handler)  # the package logger may not propagate to the root
    caplog.set_level(logging.INFO, logger="trainfast")
    try:
        result = run(37)
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    assert sum(" fits (" in m or " out of memory (" in m for m in lines) == len(result.tried)
    assert any("37 is the largest that fits" in m for m in lines)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"start": 0}, ValueError, r"start=0 .*pass start=1 or more"),
    ({"start": 16, "max_batch": 8}, ValueError, r"max_batch=8 is smaller than start=16; pass max_batch >= 16"),
    ({"start": 2.5}, TypeError, r"start=2.5 must be an int"),
    ({"precision": "fp8"}, ValueError, r"precision='fp8' is not valid"),
    ({"device": "gpu"}, ValueError, r"device='gpu' is not valid"),
    ({"batch_loss": 3}, TypeError, r"batch_loss must be callable"),
])
def test_arguments_are_checked(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        find_batch_size(nn.Linear(4, 3), torch.randn(4), **kwargs)  # type: ignore[arg-type]


def test_sample_must_be_a_tensor_or_a_pair() -> None:
    with pytest.raises(TypeError, match=r"sample must be one tensor .*got list"):
        find_batch_size(nn.Linear(4, 3), [torch.randn(4)])  # type: ignore[arg-type]


def test_result_to_json() -> None:
    data = json.loads(json.dumps(run(37).to_json()))
    assert data["batch_size"] == 37 and data["first_oom"] == 64 and data["device"] == "cpu"
    assert data["tried"][0] == {"batch_size": 8, "fitted": True, "seconds": data["tried"][0]["seconds"]}


def test_real_cpu_run_reaches_max_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bs, "free_memory", REAL_RELEASE)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    result = find_batch_size(model, torch.randn(16), device="cpu", max_batch=64)
    assert result.batch_size == 64 and result.first_oom is None
    assert [(b, ok) for b, ok, _ in result.tried] == [(8, True), (16, True), (32, True), (64, True)]
    assert all(p.grad is None for p in model.parameters()) and model.training


@pytest.mark.gpu
def test_real_cuda_oom_is_caught_and_memory_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bs, "free_memory", REAL_RELEASE)
    total = torch.cuda.get_device_properties(0).total_memory
    sample = torch.ones(total // 64 // 4, device="cuda")  # 1/64 of the device per sample, ~3 copies per step
    model = Scale().cuda()
    before = torch.cuda.memory_allocated()
    result = find_batch_size(model, sample, device="cuda", precision="32-true")
    assert result.first_oom is not None and 1 <= result.batch_size < result.first_oom < 64
    assert torch.cuda.memory_allocated() == before and model.w.grad is None
