"""The training step a tuning co-runs when the user gives none: the Trainer's step for a reference model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainfast.data.images import Normalize
from trainfast.loader.prefetch import InputTransform, move
from trainfast.precision.policy import LossScaler, device_caps, resolve_precision
from trainfast.trainer.loop import resolve_channels_last
from trainfast.trainer.optimizer import default_optimizer
from trainfast.tune.trial import StepFn


def training_step(model: nn.Module, *, normalize: Normalize | None, device: torch.device,
                  precision: str = "auto", grad_clip: float | None = 1.0) -> StepFn:
    """One step as `Trainer.fit` takes it: uint8 -> normalised inputs, autocast forward, scaled backward,
    clipping, AdamW step. The model is moved to `device` (channels_last for conv nets where it pays)."""
    policy = resolve_precision(precision, device_caps(device))
    channels_last = resolve_channels_last("auto", model, device, policy.autocast_dtype is not None)
    model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)  # type: ignore[call-overload]
    optimizer = default_optimizer(model, 1e-3, 0.05, device)
    scaler = LossScaler(device, policy.needs_scaler)
    transform = InputTransform(device, normalize, channels_last)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: Any) -> None:
        inputs, targets = transform(move(batch, device, non_blocking=True))
        with policy.autocast():
            loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        if grad_clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return step
