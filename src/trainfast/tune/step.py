"""The training step a tuning co-runs when the user gives none: the Trainer's step for a reference model."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainfast.loader.prefetch import InputTransform, Normalize, move
from trainfast.trainer.config import TrainConfig
from trainfast.trainer.step import TrainStep, prepare_step


def training_step(model: nn.Module, *, normalize: Normalize | None, device: torch.device,
                  precision: str = "auto", grad_clip: float | None = 1.0) -> TrainStep:
    """One step as `Trainer.fit` takes it (`prepare_step` with the default TrainConfig's AdamW, `default_batch_loss`):
    uint8 -> normalised inputs, autocast forward, scaled backward, clipping, AdamW step. The model is moved to
    `device` (channels_last for conv nets where it pays)."""
    defaults = TrainConfig()
    prepared = prepare_step(model, device, lr=defaults.lr, weight_decay=defaults.weight_decay, precision=precision)
    transform = InputTransform(device, normalize, prepared.channels_last)

    def step(batch: Any) -> None:
        prepared(transform(move(batch, device, non_blocking=True)), grad_clip=grad_clip)
    return step
