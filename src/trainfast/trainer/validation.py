"""Validation: the mean loss over a loader (and the accuracy for class-index targets), with one host sync at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainfast.precision.policy import PrecisionPolicy
from trainfast.samples import batch_samples
from trainfast.trainer.distributed import all_sum
from trainfast.trainer.step import LossOf


def validate(model: nn.Module, batches: Iterable[Any], *, device: torch.device, precision: PrecisionPolicy,
             loss_of: LossOf, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
             limit: int | None) -> dict[str, float]:
    """`val_loss` (and `val_accuracy`) over every rank's shard, under `precision`'s autocast and no_grad. `loss_fn`
    scores `(inputs, targets)` batches from the output (so that accuracy needs no second forward); other batches, or
    every batch when it is None, go through `loss_of`."""
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    seen = 0
    classify = True
    with torch.no_grad(), precision.autocast():
        for i, batch in enumerate(batches):
            if limit is not None and i >= limit:
                break
            n = batch_samples(batch)
            if loss_fn is None or not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                loss_sum += loss_of(model, batch).float() * n
                classify = False
            else:
                inputs, targets = batch
                out = model(inputs)
                loss_sum += loss_fn(out, targets).float() * n
                classify = classify and out.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point()
                if classify:
                    correct += (out.argmax(dim=1) == targets).sum()
            seen += n
    model.train()
    total_loss, total_correct, total_seen = all_sum(  # every rank validated its own shard
        [float(loss_sum.item()), float(correct.item()), float(seen)], device)
    if total_seen == 0:
        return {}
    metrics = {"val_loss": total_loss / total_seen}
    if classify:
        metrics["val_accuracy"] = total_correct / total_seen
    return metrics
