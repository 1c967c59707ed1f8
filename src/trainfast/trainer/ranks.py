"""What the training loop does differently when it is one of several ranks: DDP's wrapper, no all-reduce inside a
gradient-accumulation cycle, and stops agreed by every rank at the same step."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainfast.trainer.distributed import dist_initialized
from trainfast.trainer.signals import StopSchedule, StopSignal

_NOTHING = nullcontext()  # reusable: no object built per step


class Ranks:
    def __init__(self) -> None:
        self.ddp: DistributedDataParallel | None = None
        self.alone = True  # no other rank to agree with
        self.stops = StopSchedule()

    def start(self, model: nn.Module, device: torch.device, distributed: bool) -> nn.Module:
        """At the start of a fit: the model to train, DDP-wrapped when distributed (compile comes after, in
        Practices: compiling the DDP module lets dynamo split graphs at buckets)."""
        self.stops = StopSchedule()
        if distributed:
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(model, device_ids=ids)
        self.alone = self.ddp is None and not dist_initialized()  # read once: ~1 us a step otherwise
        return self.ddp if self.ddp is not None else model

    def sync_grads(self, boundary: bool) -> AbstractContextManager[object]:
        """Inside a gradient-accumulation cycle DDP need not all-reduce: only the cycle's last backward does."""
        return self.ddp.no_sync() if self.ddp is not None and not boundary else _NOTHING

    def stop_agreed(self, stop: StopSignal, step: int, at_log_point: bool, device: torch.device) -> bool:
        """Stop now? Alone: whenever a signal came. Distributed: every rank at the same step, so the ranks agree
        every few seconds and at log points (a collective then, no per-step sync); a scheduler may signal only
        some ranks."""
        if self.alone:
            return stop.requested is not None
        return (at_log_point or self.stops.due(step)) and self.stops.agree(stop.requested is not None, step, device)
