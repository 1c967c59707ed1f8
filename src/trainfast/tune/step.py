"""The training step a tuning co-runs when the user gives none: the Trainer's step for a reference model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainfast.loader.prefetch import InputTransform, Normalize, move
from trainfast.precision.policy import LossScaler, device_caps, resolve_precision
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.optimizer import default_optimizer
from trainfast.trainer.practices import resolve_channels_last
from trainfast.trainer.step import TrainStep, forward_backward, optimizer_step


def training_step(model: nn.Module, *, normalize: Normalize | None, device: torch.device,
                  precision: str = "auto", grad_clip: float | None = 1.0) -> TrainStep:
    """One step as `Trainer.fit` takes it (its step functions, the default TrainConfig's AdamW): uint8 ->
    normalised inputs, autocast forward, scaled backward, clipping, AdamW step. The model is moved to `device`
    (channels_last for conv nets where it pays)."""
    policy = resolve_precision(precision, device_caps(device))
    channels_last = resolve_channels_last("auto", model, device, policy.autocast_dtype is not None)
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)  # type: ignore[call-overload]
    defaults = TrainConfig()
    optimizer = default_optimizer(model, defaults.lr, defaults.weight_decay, device)
    scaler = LossScaler(device, policy.needs_scaler)
    transform = InputTransform(device, normalize, channels_last)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: Any) -> None:
        forward_backward(model, transform(move(batch, device, non_blocking=True)), _cross_entropy, policy.autocast(),
                         scaler)
        optimizer_step(optimizer, scaler, params, grad_clip)
    return step


def _cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)
