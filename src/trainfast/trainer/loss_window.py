"""The training loss between log points: summed on the device (no host sync per step), read at log points and epoch
ends, and the policy for a loss that is no longer finite."""

from __future__ import annotations

import logging
import math

import torch

from trainfast.precision.policy import LossScaler
from trainfast.trainer.distributed import all_sum

log = logging.getLogger("trainfast")


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; no checkpoint was written after it did."""


class LossWindow:
    """The losses of the batches since the last read (on the device), and the epoch's so far (on the host)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sum, self._count = torch.zeros((), device=device), 0  # since the last read
        self.epoch = [0.0, 0]  # sum, batches: folded in at each read; saved in checkpoints as "epoch_loss"
        self.last: float | None = None  # mean training loss at the last read
        self._skipped_seen = 0
        self.from_step = 0  # optimizer step at which the window being summed began

    def add(self, loss: torch.Tensor) -> None:
        self._sum.add_(loss.detach())
        self._count += 1

    def epoch_mean(self) -> float | None:
        total, count = self.epoch
        return total / count if count else None

    def read(self, step: int, scaler: LossScaler, explain: str) -> float | None:
        """The window's mean over every rank (collective under DDP: every rank has taken the same steps and calls it
        together), or None when empty or when the fp16 loss scaler skipped the overflowing steps. A loss that stays
        non-finite raises NonFiniteLossError: `explain` says where and what to try."""
        if self._count == 0:
            return None
        total, count = all_sum([float(self._sum.item()), float(self._count)], self.device)
        self._sum.zero_()
        self._count = 0
        self.last = total / count
        skipped = scaler.skipped_steps if scaler.enabled else 0
        new_skips, self._skipped_seen = skipped - self._skipped_seen, skipped
        steps, self.from_step = step - self.from_step, step  # optimizer steps, not batches
        if not math.isfinite(total):
            if scaler.enabled and new_skips < max(steps, 1):
                # fp16 overflow that the scaler skipped: expected while the loss scale settles
                log.warning("%d of the last %d optimizer steps were skipped by the loss scaler (non-finite "
                            "gradients)", new_skips, steps)
                return None
            raise NonFiniteLossError(f"training loss became non-finite ({total}) within the {count} batches before "
                                     f"step {step} {explain}")
        self.epoch[0] += total
        self.epoch[1] += count
        return total / count
