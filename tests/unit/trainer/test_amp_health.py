"""AMP health: the fp16 loss scale at log points and in the result, a warning when it keeps falling, and
skipped steps counted against optimizer steps (not micro-batches) under gradient accumulation."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from trainfast import TrainConfig, Trainer, make_loader
from trainfast.precision.policy import ScaleWatch
from trainfast.trainer.loop import NonFiniteLossError


class Metrics:
    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.logged.append(dict(metrics))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)


def fit(precision: str, callbacks: list[Any], **kw: Any) -> Any:
    cfg = TrainConfig(epochs=1, log_every=2, device="cpu", progress=False, monitor=False, precision=precision, **kw)
    return Trainer(nn.Linear(4, 2), config=cfg, callbacks=callbacks).fit(make_loader(data(), 8, device="cpu"))


def test_fp16_logs_the_loss_scale_and_the_result_carries_it() -> None:
    metrics = Metrics()
    result = fit("16-mixed", [metrics])
    assert [m["loss_scale"] for m in metrics.logged] == [2.0**16] * 4  # no overflow on this tiny model
    assert result.loss_scale == 2.0**16 and result.to_json()["loss_scale"] == 2.0**16


def test_without_a_scaler_there_is_no_scale() -> None:
    metrics = Metrics()
    result = fit("32-true", [metrics])
    assert all("loss_scale" not in m for m in metrics.logged)
    assert result.loss_scale is None and result.to_json()["loss_scale"] is None


@pytest.mark.parametrize(("bf16", "names"), [(True, "precision='bf16-mixed'"), (False, "lower lr")])
def test_a_scale_that_keeps_falling_is_named_once_with_the_fix(bf16: bool, names: str) -> None:
    watch = ScaleWatch(bf16_here=bf16)
    said = [watch.observe(s) for s in (65536.0, 32768.0, 65536.0, 16384.0, 4096.0, 1024.0, 256.0)]
    assert said[:5] == [None] * 5  # a rise in between resets the count
    assert said[5] is not None and "fell at each of the last 3 log points (65536 -> 1024)" in said[5]
    assert names in said[5] and said[6] is None  # once


def inf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, _ = batch
    return model(inputs).float().sum() * float("inf")


def test_under_accumulation_skips_are_compared_with_optimizer_steps(caplog: pytest.LogCaptureFixture) -> None:
    """Every optimizer step skipped (the loss is always inf): training cannot go on, whatever the micro-batches.
    Counted against the 4 micro-batches of a log window, 2 skips looked like an fp16 scale settling."""
    cfg = TrainConfig(epochs=1, log_every=2, accumulate=2, device="cpu", progress=False, monitor=False,
                      precision="16-mixed", grad_clip=None)
    trainer = Trainer(nn.Linear(4, 2), config=cfg, batch_loss=inf_loss)
    with caplog.at_level(logging.WARNING, logger="trainfast"), pytest.raises(NonFiniteLossError):
        trainer.fit(make_loader(data(), 8, device="cpu"))
    assert trainer.scaler.skipped_steps == 2 and trainer.step == 2


def test_the_progress_line_shows_the_scale(caplog: pytest.LogCaptureFixture) -> None:
    from trainfast.trainer.progress import ProgressReporter

    with caplog.at_level(logging.INFO, logger="trainfast"), \
            ProgressReporter(enabled=True, total_steps=10, interval_s=0.0, epochs=1) as bar:
        bar.loss, bar.loss_scale = 0.5, 32768.0
        bar.show(0.0, step=2, epoch=0, samples_per_s=100.0, wait_fraction=0.1)
    assert "loss 0.5000 | scale 32768" in caplog.text
