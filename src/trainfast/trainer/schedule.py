"""Learning-rate schedule: linear warm-up, then cosine decay to `final_fraction` of the peak."""

from __future__ import annotations

import math
import warnings

import torch


class WarmupCosine:
    """A picklable `LambdaLR` factor (its fields go into the scheduler's state_dict)."""

    def __init__(self, warmup_steps: int, total_steps: int, final_fraction: float = 0.0) -> None:
        self.warmup_steps, self.total_steps, self.final_fraction = warmup_steps, max(1, total_steps), final_fraction

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.final_fraction + (1 - self.final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int,
                  total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(min(warmup_steps, total_steps), total_steps))


def step_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler | None, scaled: bool) -> None:
    """One scheduler step after an optimizer step. With a loss scaler (`scaled`), a step it skipped (inf gradients,
    normal while the scale settles) makes torch warn that the schedule ran ahead of the optimizer; knowing would
    need a host sync every step, so the warning is silenced instead."""
    assert scheduler is not None
    if not scaled:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
        scheduler.step()
