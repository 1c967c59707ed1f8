"""One training step, written once: the forward under autocast and the (scaled) backward, then unscale, clip,
optimizer step and zero_grad. The Trainer's loop, the tuner's co-running step, `find_batch_size`, the doctor's
`diagnose()` and the GPU suite all take their steps through these two functions."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from trainfast.precision.policy import LossScaler

LossOf = Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> the batch's loss: Trainer/find_batch_size
TrainStep = Callable[[Any], Any]  # (batch) -> None: a whole training step, as tune_loader and diagnose co-run it
RENAMED_STEP_FN = ("step_fn is now batch_loss (model, batch) -> loss; step_fn means a whole training step "
                   "(batch) -> None, as in tune_loader and diagnose")


def renamed_step_fn(batch_loss: LossOf | None, step_fn: LossOf | None) -> LossOf | None:
    """`batch_loss`, or the same callable passed under its old name (with a DeprecationWarning)."""
    if step_fn is None:
        return batch_loss
    if batch_loss is not None:
        raise TypeError("pass batch_loss only (step_fn is its old name)")
    warnings.warn(RENAMED_STEP_FN, DeprecationWarning, stacklevel=3)
    return step_fn


def forward_backward(model: nn.Module, batch: Any, loss_of: LossOf, autocast: AbstractContextManager[object],
                     scaler: LossScaler | None = None, accumulate: int = 1) -> torch.Tensor:
    """The loss of `batch` under `autocast`, then its backward (outside autocast, as torch.amp asks), scaled by
    the loss scaler when one is given and divided by `accumulate` (micro-batches per optimizer step)."""
    with autocast:
        loss = loss_of(model, batch)
    part = loss / accumulate if accumulate > 1 else loss
    (scaler.scale(part) if scaler is not None else part).backward()
    return loss


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: LossScaler, params: Sequence[torch.Tensor],
                   grad_clip: float | None) -> None:
    """Unscale and clip the gradients (the norm is the true one), step (skipped by the scaler on inf/NaN), and
    free the gradients (`set_to_none`: the next backward writes them instead of adding to zeros)."""
    if grad_clip is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
