"""The Trainer's MFU: one batch's FLOPs counted once, on a step no rate includes; the peak taken once per fit, its
time left out of the steps; compiled models not counted, with the reason; MFU on the progress line."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainfast import flops
from trainfast.flops import FlopCounter, Peak, count_flops, precision_of
from trainfast.loader.memory import TensorLoader
from trainfast.trainer import mfu
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.loop import Trainer

BATCH = 16


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 4))


def data(steps: int, shape: tuple[int, ...] = (12,)) -> TensorLoader:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    return TensorLoader((torch.randn(n, *shape, generator=g), torch.randint(0, 4, (n,), generator=g)), BATCH,
                        shuffle=False)


def config(**overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {"epochs": 2, "progress": False, "device": "cpu", "precision": "32-true",
                              "channels_last": False, "compile": False}
    return TrainConfig(**(values | overrides))


def test_fit_reports_the_flops_of_one_step_and_an_mfu() -> None:
    model = mlp()
    x, y = next(iter(data(1)))
    expected = count_flops(lambda: F.cross_entropy(model(x), y).backward())
    model.zero_grad(set_to_none=True)
    result = Trainer(model, config=config()).fit(data(6))
    assert result.flops_per_step == pytest.approx(expected, rel=1e-6)
    assert result.peak_flops_per_s is not None and result.peak_flops_per_s > 0
    assert result.peak_source is not None and result.peak_source.startswith("measured: ")
    assert "float32" in result.peak_source  # the run's precision
    assert (result.mfu is not None and 0 < result.mfu <= 1) or (result.mfu is None and result.mfu_reason), result
    out = result.to_json()
    assert {"mfu", "mfu_reason", "flops_per_step", "peak_flops_per_s", "peak_source"} <= set(out)


def test_flops_are_counted_once_on_a_warm_up_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counted step runs under a dispatch mode (slower): it must be one StepClock leaves out of every rate, and
    no other step may pay for the counting."""
    trainer = Trainer(mlp(), config=config())
    at: list[int] = []
    start = FlopCounter.start

    def spy(self: FlopCounter) -> FlopCounter:
        at.append(len(trainer.clock.step_s))
        return start(self)

    monkeypatch.setattr(FlopCounter, "start", spy)
    trainer.fit(data(6))
    trainer.config = config(epochs=3)
    trainer.fit(data(6))  # a second fit on the same Trainer reuses the count
    assert at == [0]


def test_the_peak_is_taken_once_per_fit_and_left_out_of_the_step_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an A/B running, the precision is settled only after it: the peak is taken then, inside the loop, and
    its time (here 0.4 s) must not be booked to the step being timed."""
    calls: list[tuple[torch.dtype, str]] = []

    def slow_peak(device: torch.device, dtype: torch.dtype, *, threads: int) -> Peak:
        calls.append((dtype, precision_of(device, dtype)))
        time.sleep(0.4)
        return Peak(1e12, precision_of(device, dtype), "measured: fake")

    monkeypatch.setattr(mfu, "device_peak", slow_peak)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
    trainer = Trainer(model, config=config(epochs=1, channels_last="auto"))
    result = trainer.fit(data(30, (3, 6, 6)))
    assert result.channels_last is not None and result.channels_last["measured"] is True  # the A/B ran
    assert calls == [(torch.float32, "fp32")]
    assert max(trainer.clock.step_s) < 0.4, max(trainer.clock.step_s)
    assert result.wall_s > 0.4
    assert result.peak_source == "measured: fake" and result.mfu is not None and 0 < result.mfu <= 1


def test_an_ab_decided_before_its_step_still_takes_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that fails ends its A/B as the step begins (no step of it is timed): the peak is due then too."""
    def fail(model: nn.Module) -> nn.Module:
        raise RuntimeError("inductor: no working C++ compiler found")

    monkeypatch.setattr(torch, "compile", fail)
    monkeypatch.setattr(mfu, "device_peak", lambda device, dtype, threads: Peak(1e12, "fp32", "fake"))
    result = Trainer(mlp(), config=config(compile="auto")).fit(data(6))  # 12 steps: the compile A/B runs
    assert result.compile is not None and "compilation failed" in result.compile["reason"]
    assert result.peak_source == "fake" and result.mfu is not None


def test_an_mfu_over_one_is_reported_as_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mfu, "device_peak", lambda *a, **k: Peak(1.0, "fp32", "table: NVIDIA Nothing, dense fp32"))
    result = Trainer(mlp(), config=config()).fit(data(6))
    assert result.mfu is None
    assert result.mfu_reason is not None and "the table is wrong for this device" in result.mfu_reason


@pytest.mark.torch_compile
@pytest.mark.parametrize("how", ["compiled by the user", "compile=True"])
def test_a_compiled_model_is_not_counted(monkeypatch: pytest.MonkeyPatch, trainfast_log: pytest.LogCaptureFixture,
                                         how: str) -> None:
    """A dispatch mode would make torch.compile recompile; the eager backend keeps the test to dynamo's tracing."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(mfu, "device_peak", lambda *a, **k: pytest.fail("took a peak for a model of unknown FLOPs"))
    try:
        if how == "compile=True":  # 6 steps: too short a run for the compile A/B, so compiled from the first step
            trainer = Trainer(mlp(), config=config(compile=True))
        else:
            trainer = Trainer(torch.compile(mlp()), config=config())  # type: ignore[arg-type]
        result = trainer.fit(data(3))
    finally:
        torch._dynamo.reset()
    assert result.mfu is None and result.flops_per_step is None and result.peak_flops_per_s is None
    assert result.mfu_reason is not None and "compiled" in result.mfu_reason
    assert any("MFU: FLOPs not counted: the model is compiled" in r.getMessage() for r in trainfast_log.records)


@pytest.mark.torch_compile
def test_a_model_compiled_by_the_ab_keeps_the_count_of_its_eager_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile A/B starts eager: the first step is counted there, and the compiled steps do the same math."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    model = mlp()
    x, y = next(iter(data(1)))
    expected = count_flops(lambda: F.cross_entropy(model(x), y).backward())
    model.zero_grad(set_to_none=True)
    try:
        result = Trainer(model, config=config(compile=True)).fit(data(6))  # 12 steps: the A/B runs
    finally:
        torch._dynamo.reset()
    assert result.compile is not None and result.compile["chosen"] == "compiled" and result.compile["measured"]
    assert result.flops_per_step == expected
    assert result.mfu is not None or result.mfu_reason, result


def test_the_progress_line_shows_mfu_beside_the_rate(trainfast_log: pytest.LogCaptureFixture) -> None:
    Trainer(mlp(), config=config(progress=True, log_interval_s=0.0)).fit(data(6))
    lines = [r.getMessage() for r in trainfast_log.records if " samples/s" in r.getMessage()]
    assert lines and all("samples/s (MFU " in line for line in lines), lines


@pytest.mark.gpu
def test_mfu_on_a_gpu_takes_the_datasheet_peak_where_the_table_has_one() -> None:
    result = Trainer(mlp(), config=config(device="cuda", precision="bf16-mixed")).fit(data(20))
    assert result.flops_per_step is not None and result.flops_per_step > 0
    assert result.peak_source is not None
    assert result.peak_source.startswith("table: ") == (flops.table_peak(torch.cuda.get_device_name(), "bf16")
                                                       is not None), result.peak_source
    assert (result.mfu is not None and 0 < result.mfu <= 1) or (result.mfu is None and result.mfu_reason), result
