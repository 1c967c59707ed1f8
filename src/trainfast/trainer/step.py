"""One training step, written once: how a model is set up for it (`prepare_step`), the default loss of a batch
(`default_batch_loss`), the forward under autocast and the (scaled) backward, then unscale, clip, optimizer step and
zero_grad. The Trainer's loop, the tuner's co-running step, `find_batch_size`, the doctor's `diagnose()`, the
compile probe and the GPU suite all take their steps through these functions."""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainfast.precision import DeviceCaps, LossScaler, PrecisionPolicy, ScalerConfig, device_caps, resolve_precision
from trainfast.samples import first_leaf
from trainfast.trainer.optimizer import default_optimizer

log = logging.getLogger("trainfast")
LossOf = Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> the batch's loss: Trainer/find_batch_size
TrainStep = Callable[[Any], Any]  # (batch) -> None: a whole training step, as tune_loader and diagnose co-run it
RENAMED_STEP_FN = ("step_fn is now batch_loss (model, batch) -> loss; step_fn means a whole training step "
                   "(batch) -> None, as in tune_loader and diagnose")


def default_batch_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of `batch` when no loss is given: the one rule of the Trainer, `tune`, `find_batch_size` and
    `diagnose(loader, model=...)`.

    - `(inputs, targets)` (a tuple or list of two): `out = model(inputs)`; cross-entropy against class indices (an
      integer tensor; the class dimension is 1, as in torch) or class probabilities (a floating tensor of the
      output's shape, 2+ classes); against other floating targets (regression) the mean squared error.
    - A mapping (Hugging Face style, `{"input_ids": ..., "labels": ...}`) whose keys `model.forward` takes:
      `out = model(**batch)`, less `labels` unless `forward` names a `labels` parameter (the model then computes
      its own loss). The loss is the output's `loss` (attribute or key) when it is a tensor; otherwise of its
      logits (the output itself when a tensor, else its `logits`, else its first tensor, depth first): a 0-dim one
      is the loss itself; with integer `labels` the cross-entropy of the logits flattened over all but their last
      dimension (`ignore_index=-100`, as Hugging Face); otherwise their mean.

    Anything else raises TypeError naming the layout and the fix (`batch_loss=`)."""
    if isinstance(batch, Mapping):
        return _mapping_loss(model, batch)
    inputs, targets = unpack_pair(batch)
    return pair_loss(model(inputs), targets)


def pair_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`default_batch_loss`'s rule for an `(inputs, targets)` batch, given the model's output: cross-entropy against
    class indices or class probabilities, else the mean squared error."""
    if isinstance(targets, torch.Tensor) and targets.is_floating_point() and not _probabilities(out, targets):
        return F.mse_loss(out.float(), targets.float())
    return F.cross_entropy(out, targets)


def unpack_pair(batch: Any) -> tuple[Any, Any]:
    """`(inputs, targets)` from a batch of two, or TypeError saying what the batch was and what to pass instead."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    shape = (f" with keys {list(batch)}" if isinstance(batch, Mapping)
             else f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    raise TypeError(f"a batch must be (inputs, targets); got {type(batch).__name__}{shape}. A mapping goes in as the "
                    "model's keyword arguments (Hugging Face style) when model.forward takes its keys. For other batch "
                    "layouts pass Trainer(..., batch_loss=lambda model, batch: loss)")


def _probabilities(out: Any, targets: torch.Tensor) -> bool:
    return isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[1] > 1 and out.shape == targets.shape


def _mapping_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    names = _forward_names(model)
    passed = {k: v for k, v in batch.items() if k != "labels" or (names is not None and "labels" in names)}
    if names is not None and not set(passed) <= names:
        unpack_pair(batch)  # raises: these keys are not the model's arguments
    return mapping_output_loss(model(**passed), batch.get("labels"))


def mapping_output_loss(out: Any, labels: Any) -> torch.Tensor:
    """The loss of a model's output for a mapping batch with these `labels` (the rule in `default_batch_loss`)."""
    loss = _field(out, "loss")
    if isinstance(loss, torch.Tensor):
        return loss
    logits = out if isinstance(out, torch.Tensor) else _field(out, "logits")
    if not isinstance(logits, torch.Tensor):
        logits = first_leaf(out)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"found no loss and no tensor in the model's output ({type(out).__name__}); pass your own "
                        "loss: Trainer(..., batch_loss=...) or diagnose(loader, step_fn)")
    if logits.dim() == 0:  # a scalar output is a loss (Hugging Face's tuples put it first)
        return logits
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and logits.dim() >= 2:
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
    return logits.float().mean()


def _field(out: Any, name: str) -> Any:
    """`out.name` or `out[name]` (Hugging Face outputs have both), or None."""
    return out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)


def _forward_names(model: nn.Module) -> frozenset[str] | None:
    """The keyword arguments `model.forward` takes; None when it takes any (`**kwargs`) or has no signature."""
    forward = type(model).forward
    return _names(forward) if "forward" not in vars(model) else _names.__wrapped__(model.forward)


@functools.lru_cache(maxsize=64)
def _names(forward: Callable[..., Any]) -> frozenset[str] | None:
    """Cached per class (a signature costs ~20 us, a step's share when batches are mappings)."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) - {"self"}


def resolve_channels_last(setting: bool | str, model: nn.Module, device: torch.device, mixed: bool) -> bool:
    """'auto': NHWC for conv nets on the CPU (oneDNN's fast layout: 1.6x on the demo ConvNet here) or with
    mixed precision on CUDA (tensor cores read NHWC); plain fp32 CUDA convs gain little and can lose."""
    if setting != "auto":
        return bool(setting)
    has_conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    chosen = has_conv and (device.type == "cpu" or mixed)
    if has_conv:
        log.info("channels_last=%s (conv net, %s%s)", chosen, device.type, ", mixed precision" if mixed else "")
    return chosen


@dataclass
class PreparedStep:
    """A model set up for training on a device: precision, layout, optimizer and loss scaler, decided once.
    Calling it takes one whole step on a batch already on the device."""

    model: nn.Module
    device: torch.device
    caps: DeviceCaps
    precision: PrecisionPolicy
    channels_last: bool
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    params: list[torch.Tensor]

    def __call__(self, batch: Any, loss_of: LossOf = default_batch_loss, *, grad_clip: float | None = None,
                 model: nn.Module | None = None) -> torch.Tensor:
        """forward_backward, then optimizer_step; `model` runs the forward instead (a compiled wrapper of it)."""
        loss = forward_backward(self.model if model is None else model, batch, loss_of, self.precision.autocast(),
                                self.scaler)
        optimizer_step(self.optimizer, self.scaler, self.params, grad_clip)
        return loss


def prepare_step(model: nn.Module, device: torch.device, *, lr: float, weight_decay: float, precision: str = "auto",
                 channels_last: bool | str = "auto", optimizer: torch.optim.Optimizer | None = None,
                 scaler: ScalerConfig | None = None) -> PreparedStep:
    """device -> precision -> channels_last -> the model moved in that memory format -> optimizer (AdamW by default,
    made after the move so its state follows the parameters; `lr`, `weight_decay` are its) -> loss scaler (fp16
    only). Raises ValueError for a precision this device cannot run."""
    caps = device_caps(device)
    policy = resolve_precision(precision, caps)
    nhwc = resolve_channels_last(channels_last, model, device, policy.autocast_dtype is not None)
    moved: nn.Module = model.to(device, memory_format=torch.channels_last if nhwc  # type: ignore[call-overload]
                                else torch.preserve_format)
    return PreparedStep(moved, device, caps, policy, nhwc,
                        optimizer or default_optimizer(moved, lr, weight_decay, device),
                        LossScaler(device, policy.needs_scaler, scaler),
                        [p for p in moved.parameters() if p.requires_grad])


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
